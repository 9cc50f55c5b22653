//! The last minutes of each pipeline, kept while the host runs so that the console shows them
//! as soon as it is opened: the outcome counters every `EVERY` (in memory, always), and what
//! the source holds (waiting, unacknowledged, dead letters) with the outbox backlog every
//! `DEPTHS_EVERY` while someone reads `/admin/history`, asked of the broker with a connection
//! of its own: never once per page view, and no broker connections when nobody looks.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::unix_seconds;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use crate::source::{self, Depths};
use crate::store::database::Databases;
use crate::store::outbox;

/// The key the outbox backlog is kept under, beside the pipelines' depths.
const OUTBOX: &str = "(outbox)";

/// How often the counters are sampled.
const EVERY: Duration = Duration::from_secs(5);
/// How often the broker is asked for depths, while someone reads the history.
const DEPTHS_EVERY: Duration = Duration::from_secs(15);
/// How long after the last read of the history depths are still asked for.
const WATCHED_FOR: Duration = Duration::from_secs(60);
/// Samples kept: five minutes.
const KEPT: usize = 60;
/// The outcomes charted, in the order the console draws them.
const OUTCOMES: [&str; 6] = [
    "applied",
    "duplicate",
    "stale",
    "skipped",
    "rejected",
    "retried",
];

/// One sample: when, and each pipeline's outcome counters (in `OUTCOMES` order).
struct Sample {
    at: f64,
    counts: BTreeMap<String, [u64; 6]>,
}

/// The last depths of a pipeline (or the outbox backlog), or why they could not be read.
struct Depth {
    at: f64,
    read: Result<serde_json::Value, String>,
}

fn depths_json(depths: Depths) -> serde_json::Value {
    json!({
        "waiting": depths.waiting,
        "unacknowledged": depths.unacknowledged,
        "dead_letters": depths.dead_letters,
    })
}

#[derive(Default)]
pub(super) struct History {
    samples: Mutex<VecDeque<Sample>>,
    depths: Mutex<BTreeMap<String, Depth>>,
    /// When `/admin/history` was last read.
    read_at: Mutex<Option<Instant>>,
}

fn now() -> f64 {
    unix_seconds(SystemTime::now())
}

/// The outbox rows pending and parked, in every database.
async fn backlog(databases: &Databases) -> Result<(i64, i64), sqlx::Error> {
    let (mut pending, mut parked) = (0, 0);
    for (_, database) in databases.iter() {
        let backlog = outbox::backlog(&database.pool, &database.tables).await?;
        pending += backlog.pending;
        parked += backlog.parked;
    }
    Ok((pending, parked))
}

impl History {
    /// Samples `pipelines` until `shutdown`.
    pub(super) fn spawn(
        pipelines: Arc<Vec<Arc<Pipeline>>>,
        metrics: Arc<Metrics>,
        databases: Databases,
        shutdown: CancellationToken,
    ) -> Arc<History> {
        let history = Arc::new(History::default());
        let kept = Arc::clone(&history);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(EVERY);
            let mut depths_due = Instant::now();
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                kept.sample(&pipelines, &metrics);
                if kept.watched() && Instant::now() >= depths_due {
                    depths_due = Instant::now() + DEPTHS_EVERY;
                    for pipeline in pipelines.iter() {
                        let read = tokio::time::timeout(
                            Duration::from_secs(10),
                            source::depths(&pipeline.config),
                        )
                        .await
                        .map_err(|_| "no answer within 10 s".to_string())
                        .and_then(|read| read.map(depths_json).map_err(|error| error.to_string()));
                        kept.keep(pipeline.name(), read);
                    }
                    let backlog = backlog(&databases)
                        .await
                        .map(|(pending, parked)| json!({ "pending": pending, "parked": parked }))
                        .map_err(|error| error.to_string());
                    kept.keep(OUTBOX, backlog);
                }
            }
        });
        history
    }

    /// Whether someone read the history within `WATCHED_FOR`.
    fn watched(&self) -> bool {
        self.read_at
            .lock()
            .is_ok_and(|read_at| read_at.is_some_and(|at| at.elapsed() < WATCHED_FOR))
    }

    fn keep(&self, name: &str, read: Result<serde_json::Value, String>) {
        if let Ok(mut depths) = self.depths.lock() {
            depths.insert(name.to_string(), Depth { at: now(), read });
        }
    }

    fn sample(&self, pipelines: &[Arc<Pipeline>], metrics: &Metrics) {
        let counts = pipelines
            .iter()
            .map(|pipeline| {
                let name = pipeline.name();
                (
                    name.to_string(),
                    OUTCOMES.map(|outcome| metrics.messages(name, outcome)),
                )
            })
            .collect();
        if let Ok(mut samples) = self.samples.lock() {
            samples.push_back(Sample { at: now(), counts });
            while samples.len() > KEPT {
                samples.pop_front();
            }
        }
    }

    /// `GET /admin/history`: the samples, oldest first, and the last depths. A read keeps the
    /// depths coming for `WATCHED_FOR`.
    pub(super) fn json(&self) -> serde_json::Value {
        if let Ok(mut read_at) = self.read_at.lock() {
            *read_at = Some(Instant::now());
        }
        let samples: Vec<serde_json::Value> = self
            .samples
            .lock()
            .map(|samples| {
                samples
                    .iter()
                    .map(|sample| {
                        let pipelines: serde_json::Map<String, serde_json::Value> = sample
                            .counts
                            .iter()
                            .map(|(name, counts)| {
                                let counts: serde_json::Map<String, serde_json::Value> = OUTCOMES
                                    .iter()
                                    .zip(counts)
                                    .map(|(outcome, count)| (outcome.to_string(), json!(count)))
                                    .collect();
                                (name.clone(), serde_json::Value::Object(counts))
                            })
                            .collect();
                        json!({ "at": sample.at, "pipelines": pipelines })
                    })
                    .collect()
            })
            .unwrap_or_default();
        let depths: serde_json::Map<String, serde_json::Value> = self
            .depths
            .lock()
            .map(|depths| {
                depths
                    .iter()
                    .map(|(name, depth)| {
                        let mut shown = match &depth.read {
                            Ok(read) => read.clone(),
                            Err(error) => json!({ "error": error }),
                        };
                        shown["at"] = json!(depth.at);
                        (name.clone(), shown)
                    })
                    .collect()
            })
            .unwrap_or_default();
        json!({
            "interval_seconds": EVERY.as_secs(),
            "samples": samples,
            "depths": depths,
        })
    }
}
