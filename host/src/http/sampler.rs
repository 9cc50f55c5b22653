//! The gauges that are there whether or not anyone looks: every `SOURCES_EVERY` each
//! pipeline's source is asked what it holds (waiting, unsettled, the oldest one's age, dead
//! letters), and every `DATABASES_EVERY` each database for its outbox backlog and each
//! pipeline's claims. Prometheus reads them from `/metrics` (alert rules in
//! `deploy/prometheus/alerts.yml`), the console from `/admin/history`.
//!
//! A source is asked over a connection the sampler keeps (one per pipeline, opened again after
//! a failure), so sampling costs no connection churn on the broker. A read that fails or takes
//! longer than `READ_TIMEOUT` leaves the last values and says why in the history; the gauge
//! `idem_source_sampled_timestamp_seconds` stops moving, which an alert can see.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::pipeline::Pipeline;
use crate::source::{DepthProbe, Depths};
use crate::store::database::{self, Databases};
use crate::store::{outbox, retention};
use crate::telemetry::metrics::{Metrics, SourceSample};

/// How often every source is asked for its depths.
pub const SOURCES_EVERY: Duration = Duration::from_secs(15);
/// How often every database is asked for its outbox backlog and claims.
pub const DATABASES_EVERY: Duration = Duration::from_secs(60);
/// The longest one read may take.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The key the outbox backlog is kept under in [`Sampled::json`], beside the pipelines.
pub const OUTBOX: &str = "(outbox)";

/// The last reading of a pipeline's source (or of the outbox backlog), or why it failed.
struct Reading {
    at: SystemTime,
    read: Result<serde_json::Value, String>,
}

/// The last readings, for the console.
#[derive(Default)]
pub struct Sampled {
    readings: Mutex<BTreeMap<String, Reading>>,
}

impl Sampled {
    fn keep(&self, name: &str, read: Result<serde_json::Value, String>) {
        if let Ok(mut readings) = self.readings.lock() {
            let at = SystemTime::now();
            readings.insert(name.to_string(), Reading { at, read });
        }
    }

    /// Each pipeline's last reading (and the outbox's under [`OUTBOX`]): its values, or
    /// `error`, and `at` (Unix seconds).
    pub fn json(&self) -> serde_json::Map<String, serde_json::Value> {
        let Ok(readings) = self.readings.lock() else {
            return serde_json::Map::new();
        };
        readings
            .iter()
            .map(|(name, reading)| {
                let mut shown = match &reading.read {
                    Ok(read) => read.clone(),
                    Err(error) => json!({ "error": error }),
                };
                shown["at"] = json!(
                    reading
                        .at
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
                );
                (name.clone(), shown)
            })
            .collect()
    }
}

/// Samples `pipelines` and `databases` into `metrics` until `shutdown`.
pub fn spawn(
    pipelines: Arc<Vec<Arc<Pipeline>>>,
    metrics: Arc<Metrics>,
    databases: Databases,
    shutdown: CancellationToken,
) -> Arc<Sampled> {
    let sampled = Arc::new(Sampled::default());
    let kept = Arc::clone(&sampled);
    tokio::spawn(async move {
        let mut probes: Vec<DepthProbe> = pipelines.iter().map(|_| DepthProbe::default()).collect();
        let mut ticks = tokio::time::interval(SOURCES_EVERY);
        let mut databases_due = Instant::now();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            for (pipeline, probe) in pipelines.iter().zip(&mut probes) {
                let read = sample_source(pipeline, probe, &metrics).await;
                kept.keep(pipeline.name(), read);
            }
            if Instant::now() >= databases_due {
                databases_due = Instant::now() + DATABASES_EVERY;
                let backlog = sample_databases(&pipelines, &databases, &metrics).await;
                kept.keep(OUTBOX, backlog);
            }
        }
    });
    sampled
}

/// Reads `pipeline`'s source into its gauges; the reading as the console shows it.
async fn sample_source(
    pipeline: &Pipeline,
    probe: &mut DepthProbe,
    metrics: &Metrics,
) -> Result<serde_json::Value, String> {
    metrics.source_rebalances(pipeline.name(), pipeline.source_rebalances());
    let read = tokio::time::timeout(READ_TIMEOUT, probe.depths(pipeline.config())).await;
    let depths: Depths = match read {
        Ok(Ok(depths)) => depths,
        Ok(Err(error)) => return Err(error.to_string()),
        Err(_) => {
            // Whatever it was doing is abandoned: the next read starts afresh.
            *probe = DepthProbe::default();
            return Err(format!("no answer within {} s", READ_TIMEOUT.as_secs()));
        }
    };
    metrics.source_sampled(
        pipeline.name(),
        SourceSample {
            waiting: depths.waiting,
            unacknowledged: depths.unacknowledged,
            dead_letters: depths.dead_letters.unwrap_or(0),
            oldest_age: depths.oldest_age,
        },
    );
    metrics.source_partitions_sampled(pipeline.name(), &depths.partitions);
    Ok(json!({
        "waiting": depths.waiting,
        "unacknowledged": depths.unacknowledged,
        "dead_letters": depths.dead_letters,
        "oldest_age_seconds": depths.oldest_age.map(|age| age.as_secs()),
    }))
}

/// Reads every database's outbox backlog and every pipeline's claims into their gauges; the
/// outbox backlog over every database, as the console shows it.
async fn sample_databases(
    pipelines: &[Arc<Pipeline>],
    databases: &Databases,
    metrics: &Metrics,
) -> Result<serde_json::Value, String> {
    let (mut pending, mut parked, mut failed) = (0, 0, None);
    for (name, opened) in databases.iter() {
        let read = tokio::time::timeout(
            READ_TIMEOUT,
            outbox::undelivered_sample(&opened.pool, &opened.tables),
        )
        .await;
        match read {
            Ok(Ok(sample)) => {
                metrics.outbox_sampled(name.unwrap_or("default"), sample);
                pending += sample.pending;
                parked += sample.parked;
            }
            Ok(Err(error)) => failed = Some(format!("{}: {error}", database::label(name))),
            Err(_) => failed = Some(format!("{}: no answer within 10 s", database::label(name))),
        }
    }
    for pipeline in pipelines {
        let opened = databases.named(pipeline.config().database.as_deref());
        let read = tokio::time::timeout(
            READ_TIMEOUT,
            retention::claims_summary(&opened.pool, &opened.tables, &pipeline.config().consumer),
        )
        .await;
        if let Ok(Ok(claims)) = read {
            metrics.claims_sampled(
                pipeline.name(),
                claims.rows,
                claims.oldest_age.unwrap_or_default(),
                pipeline.config().retention.window,
            );
        }
    }
    match failed {
        Some(error) => Err(error),
        None => Ok(json!({ "pending": pending, "parked": parked })),
    }
}
