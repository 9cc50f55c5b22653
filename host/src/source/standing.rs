//! What a pipeline lends its source at every opening, kept across reconnections: where its
//! consumer resumes in a log read by offset (`store::offsets`, Kafka), and [`Standing`], where
//! the source says how it stands between deliveries, for `/readyz` and the sampled gauges.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::store::offsets::Offsets;

/// What a source is lent by its pipeline (the brokers that keep their consumers' positions
/// themselves use none of it).
pub struct Lent {
    pub offsets: Offsets,
    pub standing: Arc<Standing>,
}

/// How a pipeline's source stands, as it says itself.
#[derive(Debug, Default)]
pub struct Standing {
    /// Why it receives nothing now though it is open (Kafka: its brokers unreachable and no
    /// partition assigned).
    problem: Mutex<Option<String>>,
    /// Rebalances of its consumer group served (Kafka), over every opening.
    rebalances: AtomicU64,
}

impl Standing {
    pub fn problem(&self) -> Option<String> {
        self.problem
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn set_problem(&self, problem: Option<String>) {
        *self
            .problem
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = problem;
    }

    /// The group rebalanced (an assignment or a revoke served).
    pub fn rebalanced(&self) {
        self.rebalances.fetch_add(1, Ordering::Relaxed);
    }

    pub fn rebalances(&self) -> u64 {
        self.rebalances.load(Ordering::Relaxed)
    }
}
