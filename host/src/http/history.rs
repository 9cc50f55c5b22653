//! The last minutes of each pipeline, kept while the host runs so that the console shows them
//! as soon as it is opened: the outcome counters every `EVERY` (in memory), and the last
//! readings of each source and of the outbox backlog that the sampler took
//! ([`sampler`](crate::http::sampler)).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::unix_seconds;
use crate::http::sampler::Sampled;
use crate::pipeline::Pipeline;
use crate::telemetry::metrics::Metrics;

/// How often the counters are sampled.
const EVERY: Duration = Duration::from_secs(5);
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

pub(super) struct History {
    samples: Mutex<VecDeque<Sample>>,
    sampled: Arc<Sampled>,
}

fn now() -> f64 {
    unix_seconds(SystemTime::now())
}

impl History {
    /// Samples `pipelines` until `shutdown`; the sources' readings come from `sampled`.
    pub(super) fn spawn(
        pipelines: Arc<Vec<Arc<Pipeline>>>,
        metrics: Arc<Metrics>,
        sampled: Arc<Sampled>,
        shutdown: CancellationToken,
    ) -> Arc<History> {
        let history = Arc::new(History {
            samples: Mutex::default(),
            sampled,
        });
        let kept = Arc::clone(&history);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(EVERY);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                kept.sample(&pipelines, &metrics);
            }
        });
        history
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

    /// `GET /admin/history`: the samples, oldest first, and the sampler's last readings.
    pub(super) fn json(&self) -> serde_json::Value {
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
        let depths = self.sampled.json();
        json!({
            "interval_seconds": EVERY.as_secs(),
            "samples": samples,
            "depths": depths,
        })
    }
}
