//! Prometheus metrics: names, one recording function per event, and the text exposition.
//!
//! Names follow `idem_<name>_<unit>[_total]`; label values come from bounded sets
//! (pipeline names from the config, fixed outcome and result words), never message data.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

/// Every metric of one host. Cheap to share behind an `Arc`.
pub struct Metrics {
    registry: Registry,
    messages: Family<OutcomeLabels, Counter>,
    plugin_seconds: Family<PipelineLabels, Histogram>,
    transaction_seconds: Family<PipelineLabels, Histogram>,
    end_to_end_seconds: Family<PipelineLabels, Histogram>,
    database_retries: Family<RetryLabels, Counter>,
    plugin_reloads: Family<ReloadLabels, Counter>,
    claims_deleted: Family<PipelineLabels, Counter>,
    outbox_deliveries: Family<DestinationLabels, Counter>,
    pipeline_paused: Family<PipelineLabels, Gauge>,
    operator_paused: Family<PipelineLabels, Gauge>,
    batch_size: Family<PipelineLabels, Gauge>,
    sampled: Sampled,
}

/// The gauges sampled on an interval (`sampler`), whether or not anyone looks.
struct Sampled {
    waiting: Family<PipelineLabels, Gauge>,
    unacknowledged: Family<PipelineLabels, Gauge>,
    oldest_age: Family<PipelineLabels, Seconds>,
    dead_letters: Family<PipelineLabels, Gauge>,
    source_sampled_at: Family<PipelineLabels, Seconds>,
    partition_waiting: Family<PartitionLabels, Gauge>,
    rebalances: Family<PipelineLabels, Counter>,
    outbox_rows: Family<OutboxLabels, Gauge>,
    outbox_oldest_age: Family<DatabaseLabels, Seconds>,
    claims: Family<PipelineLabels, Gauge>,
    claims_oldest_age: Family<PipelineLabels, Seconds>,
    claims_retention: Family<PipelineLabels, Seconds>,
}

/// A gauge of seconds (fractions kept).
type Seconds = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DatabaseLabels {
    database: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutboxLabels {
    database: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DestinationLabels {
    destination: String,
    result: &'static str,
}

/// `idem_build_info`'s labels: what this binary is.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    /// The plugin contracts it runs, newest first: "0.3.0,0.2.0".
    contracts: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PipelineLabels {
    pipeline: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabels {
    pipeline: String,
    topic: String,
    partition: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    pipeline: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RetryLabels {
    pipeline: String,
    sqlstate: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    pipeline: String,
    result: &'static str,
}

/// 50 µs to ~26 s, four buckets an octave (each ~19 % wider than the last; Prometheus'
/// native histograms' schema 2): a quantile interpolated inside one is off by a few percent,
/// not up to half as with power-of-two buckets, which matters for a target such as
/// `batch.latency`'s 99th percentile.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 2f64.powf(0.25), 77))
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("idem");
        let messages = registered(
            &mut registry,
            "messages",
            "Messages settled, by pipeline and outcome (applied, duplicate, stale, skipped, rejected, retried, requeued)",
            Family::<OutcomeLabels, Counter>::default(),
        );
        let plugin_seconds = registered(
            &mut registry,
            "plugin_call_seconds",
            "Plugin instantiation and call time per message",
            latency_family(),
        );
        let transaction_seconds = registered(
            &mut registry,
            "transaction_seconds",
            "Claim and effects transaction time, commit included",
            latency_family(),
        );
        let end_to_end_seconds = registered(
            &mut registry,
            "message_seconds",
            "Time from delivery to settlement (ack, dead-letter or retry publish)",
            latency_family(),
        );
        let database_retries = registered(
            &mut registry,
            "database_retries",
            "Transactions retried after a transient database error, by SQLSTATE (or 'connection')",
            Family::<RetryLabels, Counter>::default(),
        );
        let plugin_reloads = registered(
            &mut registry,
            "plugin_reloads",
            "Plugin reload attempts, by result (applied, refused, unchanged)",
            Family::<ReloadLabels, Counter>::default(),
        );
        let claims_deleted = registered(
            &mut registry,
            "claims_deleted",
            "Claims deleted by retention",
            Family::<PipelineLabels, Counter>::default(),
        );
        let outbox_deliveries = registered(
            &mut registry,
            "outbox_deliveries",
            "Outbox delivery attempts, by destination and result (delivered, failed, parked)",
            Family::<DestinationLabels, Counter>::default(),
        );
        let (pipeline_paused, operator_paused) = register_pauses(&mut registry);
        let batch_size = registered(
            &mut registry,
            "batch_size",
            "The most messages the pipeline's next batch takes: batch.size, or the size adapting to batch.latency",
            Family::default(),
        );
        let sampled = Sampled::register(&mut registry);
        register_build_info(&mut registry);
        Metrics {
            registry,
            batch_size,
            operator_paused,
            sampled,
            pipeline_paused,
            outbox_deliveries,
            claims_deleted,
            messages,
            plugin_seconds,
            transaction_seconds,
            end_to_end_seconds,
            database_retries,
            plugin_reloads,
        }
    }

    /// A message ended with `outcome`.
    pub fn message_settled(&self, pipeline: &str, outcome: &'static str, elapsed: Duration) {
        self.messages
            .get_or_create(&OutcomeLabels {
                pipeline: pipeline.to_string(),
                outcome,
            })
            .inc();
        self.end_to_end_seconds
            .get_or_create(&pipeline_labels(pipeline))
            .observe(elapsed.as_secs_f64());
    }

    /// The pipeline paused (`true`) or resumed (`false`).
    pub fn pipeline_paused(&self, pipeline: &str, paused: bool) {
        self.pipeline_paused
            .get_or_create(&pipeline_labels(pipeline))
            .set(i64::from(paused));
    }

    /// The most messages the pipeline's next batch takes (see `batch_size`).
    pub fn batch_size(&self, pipeline: &str, messages: usize) {
        self.batch_size
            .get_or_create(&pipeline_labels(pipeline))
            .set(i64::try_from(messages).unwrap_or(i64::MAX));
    }

    /// The batch size last reported for `pipeline` (0 before its consumer started).
    pub fn batch_size_now(&self, pipeline: &str) -> i64 {
        self.batch_size
            .get_or_create(&pipeline_labels(pipeline))
            .get()
    }

    /// An operator paused (`true`) or resumed (`false`) the pipeline.
    pub fn pipeline_operator_paused(&self, pipeline: &str, paused: bool) {
        self.operator_paused
            .get_or_create(&pipeline_labels(pipeline))
            .set(i64::from(paused));
    }

    /// 1 while `pipeline` is paused.
    pub fn is_paused(&self, pipeline: &str) -> i64 {
        self.pipeline_paused
            .get_or_create(&pipeline_labels(pipeline))
            .get()
    }

    pub fn plugin_called(&self, pipeline: &str, elapsed: Duration) {
        self.plugin_seconds
            .get_or_create(&pipeline_labels(pipeline))
            .observe(elapsed.as_secs_f64());
    }

    pub fn transaction_finished(&self, pipeline: &str, elapsed: Duration) {
        self.transaction_seconds
            .get_or_create(&pipeline_labels(pipeline))
            .observe(elapsed.as_secs_f64());
    }

    pub fn database_retried(&self, pipeline: &str, sqlstate: &str) {
        self.database_retries
            .get_or_create(&RetryLabels {
                pipeline: pipeline.to_string(),
                sqlstate: sqlstate.to_string(),
            })
            .inc();
    }

    /// The count of transactions of `pipeline` retried after `sqlstate`.
    pub fn database_retries(&self, pipeline: &str, sqlstate: &str) -> u64 {
        self.database_retries
            .get_or_create(&RetryLabels {
                pipeline: pipeline.to_string(),
                sqlstate: sqlstate.to_string(),
            })
            .get()
    }

    pub fn outbox_delivered(&self, destination: &str, result: &'static str) {
        self.outbox_deliveries
            .get_or_create(&DestinationLabels {
                destination: destination.to_string(),
                result,
            })
            .inc();
    }

    pub fn plugin_reloaded(&self, pipeline: &str, result: &'static str) {
        self.plugin_reloads
            .get_or_create(&ReloadLabels {
                pipeline: pipeline.to_string(),
                result,
            })
            .inc();
    }

    pub fn claims_deleted(&self, pipeline: &str, deleted: u64) {
        self.claims_deleted
            .get_or_create(&pipeline_labels(pipeline))
            .inc_by(deleted);
    }

    /// The count of messages of `pipeline` that ended as `outcome`.
    pub fn messages(&self, pipeline: &str, outcome: &'static str) -> u64 {
        self.messages
            .get_or_create(&OutcomeLabels {
                pipeline: pipeline.to_string(),
                outcome,
            })
            .get()
    }

    /// The count of reload attempts of `pipeline` that ended as `result`.
    pub fn plugin_reloads(&self, pipeline: &str, result: &'static str) -> u64 {
        self.plugin_reloads
            .get_or_create(&ReloadLabels {
                pipeline: pipeline.to_string(),
                result,
            })
            .get()
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!(%error, "Cannot encode metrics.");
        }
        text
    }
}

/// Registers `metric` in `registry` as `name` (after the `idem_` prefix) with `help`;
/// returns the handle that records into it.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A per-pipeline latency histogram family.
fn latency_family() -> Family<PipelineLabels, Histogram> {
    Family::new_with_constructor(latency_histogram as fn() -> Histogram)
}

/// `idem_build_info`: 1, with the version and plugin contracts as labels (the convention of
/// `<program>_build_info`, to join on or alert when hosts run different builds).
fn register_build_info(registry: &mut Registry) {
    let build_info = registered(
        registry,
        "build_info",
        "1, labelled with this binary's version and the plugin contracts it runs",
        Family::<BuildLabels, Gauge>::default(),
    );
    build_info
        .get_or_create(&BuildLabels {
            version: env!("CARGO_PKG_VERSION"),
            contracts: crate::sandbox::contract::SPOKEN.join(","),
        })
        .set(1);
}

/// The two pause gauges: a configuration fault's, an operator's.
fn register_pauses(
    registry: &mut Registry,
) -> (Family<PipelineLabels, Gauge>, Family<PipelineLabels, Gauge>) {
    let pipeline_paused = registered(
        registry,
        "pipeline_paused",
        "1 while the pipeline is paused by a configuration fault (see /readyz for the statement and SQLSTATE)",
        Family::default(),
    );
    let operator_paused = registered(
        registry,
        "pipeline_operator_paused",
        "1 while an operator has paused the pipeline (POST /admin/pipelines/<name>/pause, idem pause)",
        Family::default(),
    );
    (pipeline_paused, operator_paused)
}

impl Sampled {
    fn register(registry: &mut Registry) -> Sampled {
        let mut family = |name: &str, help: &str| -> Family<PipelineLabels, Gauge> {
            registered(registry, name, help, Family::default())
        };
        let waiting = family(
            "source_waiting_messages",
            "Messages waiting in the pipeline's queue or for its stream consumer, sampled",
        );
        let unacknowledged = family(
            "source_unacknowledged_messages",
            "Messages delivered to the pipeline and not settled yet (JetStream), sampled",
        );
        let dead_letters = family(
            "dead_letter_messages",
            "Messages in the pipeline's dead-letter queue or stream, sampled",
        );
        let claims = family(
            "claims",
            "Claims the pipeline keeps (rows of the claims table), sampled",
        );
        let mut seconds = |name: &str, help: &str| -> Family<PipelineLabels, Seconds> {
            registered(registry, name, help, Family::default())
        };
        let oldest_age = seconds(
            "source_oldest_unsettled_age_seconds",
            "Age of the oldest message of the pipeline not settled yet (JetStream; 0 when none), sampled",
        );
        let source_sampled_at = seconds(
            "source_sampled_timestamp_seconds",
            "When the pipeline's source last answered the sampler (Unix time)",
        );
        let claims_oldest_age = seconds(
            "claims_oldest_age_seconds",
            "Age of the pipeline's oldest claim (0 when none), sampled",
        );
        let claims_retention = seconds(
            "claims_retention_seconds",
            "The pipeline's claim retention window ([pipelines.<name>.retention] window)",
        );
        let partition_waiting: Family<PartitionLabels, Gauge> = registered(
            registry,
            "source_partition_waiting_messages",
            "Messages of one partition not committed by the pipeline's group: end offset less committed (Kafka), sampled",
            Family::default(),
        );
        let rebalances: Family<PipelineLabels, Counter> = registered(
            registry,
            "source_rebalances",
            "Rebalances of the pipeline's consumer group served, assignments and revokes (Kafka)",
            Family::default(),
        );
        let outbox_rows: Family<OutboxLabels, Gauge> = registered(
            registry,
            "outbox_rows",
            "Outbox rows not delivered, by database and state (pending, parked), sampled",
            Family::default(),
        );
        let outbox_oldest_age: Family<DatabaseLabels, Seconds> = registered(
            registry,
            "outbox_oldest_pending_age_seconds",
            "Age of the database's oldest pending outbox row (0 when none), sampled",
            Family::default(),
        );
        Sampled {
            waiting,
            unacknowledged,
            oldest_age,
            dead_letters,
            source_sampled_at,
            partition_waiting,
            rebalances,
            outbox_rows,
            outbox_oldest_age,
            claims,
            claims_oldest_age,
            claims_retention,
        }
    }
}

/// What a pipeline's source held when sampled; `None` where the source cannot tell.
#[derive(Debug, Clone, Copy, Default)]
pub struct SourceSample {
    pub waiting: u64,
    pub unacknowledged: Option<u64>,
    pub dead_letters: u64,
    pub oldest_age: Option<Duration>,
}

/// What a database's outbox held when sampled.
#[derive(Debug, Clone, Copy, Default)]
pub struct OutboxSample {
    pub pending: i64,
    pub parked: i64,
    pub oldest_pending_age: Duration,
}

fn gauge_value(count: impl TryInto<i64>) -> i64 {
    count.try_into().unwrap_or(i64::MAX)
}

impl Metrics {
    /// The sampler read `pipeline`'s source.
    pub fn source_sampled(&self, pipeline: &str, sample: SourceSample) {
        let labels = pipeline_labels(pipeline);
        let sampled = &self.sampled;
        sampled
            .waiting
            .get_or_create(&labels)
            .set(gauge_value(sample.waiting));
        if let Some(unacknowledged) = sample.unacknowledged {
            sampled
                .unacknowledged
                .get_or_create(&labels)
                .set(gauge_value(unacknowledged));
        }
        sampled
            .dead_letters
            .get_or_create(&labels)
            .set(gauge_value(sample.dead_letters));
        if let Some(age) = sample.oldest_age {
            sampled
                .oldest_age
                .get_or_create(&labels)
                .set(age.as_secs_f64());
        }
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        sampled
            .source_sampled_at
            .get_or_create(&labels)
            .set(now.as_secs_f64());
    }

    /// The sampler read what waits in each partition of `pipeline`'s topics (Kafka).
    pub fn source_partitions_sampled(
        &self,
        pipeline: &str,
        waiting: &BTreeMap<(String, i32), u64>,
    ) {
        for ((topic, partition), waiting) in waiting {
            let labels = PartitionLabels {
                pipeline: pipeline.to_string(),
                topic: topic.clone(),
                partition: partition.to_string(),
            };
            self.sampled
                .partition_waiting
                .get_or_create(&labels)
                .set(gauge_value(*waiting));
        }
    }

    /// `pipeline`'s consumer group rebalanced `total` times since the host started.
    pub fn source_rebalances(&self, pipeline: &str, total: u64) {
        let counter = self
            .sampled
            .rebalances
            .get_or_create(&pipeline_labels(pipeline));
        let counted = counter.get();
        if total > counted {
            counter.inc_by(total - counted);
        }
    }

    /// The sampler read the outbox of `database` (`default` for `[database]`).
    pub fn outbox_sampled(&self, database: &str, sample: OutboxSample) {
        let rows = |state| OutboxLabels {
            database: database.to_string(),
            state,
        };
        let sampled = &self.sampled;
        sampled
            .outbox_rows
            .get_or_create(&rows("pending"))
            .set(sample.pending);
        sampled
            .outbox_rows
            .get_or_create(&rows("parked"))
            .set(sample.parked);
        sampled
            .outbox_oldest_age
            .get_or_create(&DatabaseLabels {
                database: database.to_string(),
            })
            .set(sample.oldest_pending_age.as_secs_f64());
    }

    /// The sampler counted `pipeline`'s claims: `rows`, the oldest `oldest_age` old, kept
    /// for `retention`.
    pub fn claims_sampled(
        &self,
        pipeline: &str,
        rows: i64,
        oldest_age: Duration,
        retention: Duration,
    ) {
        let labels = pipeline_labels(pipeline);
        let sampled = &self.sampled;
        sampled.claims.get_or_create(&labels).set(rows);
        sampled
            .claims_oldest_age
            .get_or_create(&labels)
            .set(oldest_age.as_secs_f64());
        sampled
            .claims_retention
            .get_or_create(&labels)
            .set(retention.as_secs_f64());
    }
}

fn pipeline_labels(pipeline: &str) -> PipelineLabels {
    PipelineLabels {
        pipeline: pipeline.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scrape names the build before any message moved.
    #[test]
    fn the_build_is_exported() {
        let text = Metrics::new().encode();
        let line = format!(
            "idem_build_info{{version=\"{}\",contracts=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::sandbox::contract::SPOKEN.join(",")
        );
        assert!(text.contains(&line), "{text}");
    }
}
