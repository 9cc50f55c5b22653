//! Prometheus metrics: names, one recording function per event, and the text exposition.
//!
//! Names follow `idem_<name>_<unit>[_total]`; label values come from bounded sets
//! (pipeline names from the config, fixed outcome and result words), never message data.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DestinationLabels {
    destination: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PipelineLabels {
    pipeline: String,
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

fn latency_histogram() -> Histogram {
    // 50 µs … ~26 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("idem");
        let messages = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "messages",
            "Messages settled, by pipeline and outcome (applied, duplicate, stale, skipped, rejected, retried, requeued)",
            messages.clone(),
        );
        let plugin_seconds = Family::<PipelineLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "plugin_call_seconds",
            "Plugin instantiation and call time per message",
            plugin_seconds.clone(),
        );
        let transaction_seconds = Family::<PipelineLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "transaction_seconds",
            "Claim and effects transaction time, commit included",
            transaction_seconds.clone(),
        );
        let end_to_end_seconds = Family::<PipelineLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "message_seconds",
            "Time from delivery to settlement (ack, dead-letter or retry publish)",
            end_to_end_seconds.clone(),
        );
        let database_retries = Family::<RetryLabels, Counter>::default();
        registry.register(
            "database_retries",
            "Transactions retried after a transient database error, by SQLSTATE (or 'connection')",
            database_retries.clone(),
        );
        let plugin_reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "plugin_reloads",
            "Plugin reload attempts, by result (applied, refused, unchanged)",
            plugin_reloads.clone(),
        );
        let claims_deleted = Family::<PipelineLabels, Counter>::default();
        registry.register(
            "claims_deleted",
            "Claims deleted by retention",
            claims_deleted.clone(),
        );
        let outbox_deliveries = Family::<DestinationLabels, Counter>::default();
        registry.register(
            "outbox_deliveries",
            "Outbox delivery attempts, by destination and result (delivered, failed, parked)",
            outbox_deliveries.clone(),
        );
        let pipeline_paused = Family::<PipelineLabels, Gauge>::default();
        registry.register(
            "pipeline_paused",
            "1 while the pipeline is paused by a configuration fault (see /readyz for the statement and SQLSTATE)",
            pipeline_paused.clone(),
        );
        Metrics {
            registry,
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

fn pipeline_labels(pipeline: &str) -> PipelineLabels {
    PipelineLabels {
        pipeline: pipeline.to_string(),
    }
}
