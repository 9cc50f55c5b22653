//! How many messages a worker gathers into one transaction: `batch.size`, or, with
//! `batch.latency` set, a size that follows the load so a batch settles within that long.
//!
//! After each batch, its duration (from the moment a worker took its first delivery to its
//! last settlement: lingering, the plugin calls, waiting for the database and the acks
//! included; not the wait for a free worker, which is waiting in the queue and which a
//! smaller batch would not shorten) adjusts the size the next batches gather up to. A batch
//! over the target shrinks it in proportion, aiming at `HEADROOM` of the target so the spread
//! of durations stays under it, by half at most (one slow batch, a retry say, does not undo
//! the size); a full batch that took less than half the target grows it by a quarter (at
//! least one). A batch that was not full
//! (the source had no more) says nothing about a bigger one and leaves it. The size starts
//! at 1, stays between 1 and `batch.size`, and is shared by the pipeline's workers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::config::BatchConfig;

/// The share of the target a shrunk batch size aims at.
const HEADROOM: f64 = 0.6;

/// A pipeline's batch size, fixed or adapting (see the module).
#[derive(Debug)]
pub struct BatchSize {
    max: usize,
    target: Option<Duration>,
    current: AtomicUsize,
}

impl BatchSize {
    pub fn new(config: &BatchConfig) -> BatchSize {
        let max = config.size.get();
        let start = if config.latency.is_some() { 1 } else { max };
        BatchSize {
            max,
            target: config.latency,
            current: AtomicUsize::new(start),
        }
    }

    /// The most messages the next batch gathers.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// A batch of `messages` settled `took` after its first delivery arrived.
    pub fn settled(&self, messages: usize, took: Duration) {
        let Some(target) = self.target else {
            return;
        };
        let current = self.current();
        let next = if took > target {
            let fits = messages as f64 * HEADROOM * target.as_secs_f64() / took.as_secs_f64();
            (fits as usize).max(current / 2).min(current)
        } else if messages >= current && took < target / 2 {
            current + (current / 4).max(1)
        } else {
            current
        };
        self.current
            .store(next.clamp(1, self.max), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::*;

    fn sizer(size: usize, latency: Option<Duration>) -> BatchSize {
        BatchSize::new(&BatchConfig {
            size: NonZeroUsize::new(size).expect("a size"),
            linger: Duration::ZERO,
            latency,
        })
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn without_a_target_the_size_is_the_configured_one() {
        let size = sizer(64, None);
        assert_eq!(size.current(), 64);
        size.settled(64, 500 * MS);
        assert_eq!(size.current(), 64);
    }

    /// Batches whose duration grows with their size (1 ms plus 0.1 ms a message): the size
    /// climbs from 1 while full batches are quick, then holds where batches take between
    /// half the target and the target, never past `size`.
    #[test]
    fn the_size_settles_where_batches_fit_the_target() {
        let size = sizer(256, Some(10 * MS));
        assert_eq!(size.current(), 1);
        let cost = |messages: usize| MS + MS / 10 * messages as u32;
        for _ in 0..200 {
            let messages = size.current();
            size.settled(messages, cost(messages));
        }
        let settled = size.current();
        assert!(
            cost(settled) <= 10 * MS && cost(settled) >= 5 * MS / 2,
            "settled at {settled}, a batch of which takes {:?}",
            cost(settled)
        );
        let cheap = sizer(256, Some(10 * MS));
        for _ in 0..200 {
            cheap.settled(cheap.current(), MS);
        }
        assert_eq!(cheap.current(), 256, "bounded by batch.size");
    }

    #[test]
    fn a_slow_batch_shrinks_the_size_in_proportion_and_a_partial_one_does_not_grow_it() {
        let size = sizer(256, Some(10 * MS));
        for _ in 0..100 {
            size.settled(size.current(), MS);
        }
        assert_eq!(size.current(), 256);
        size.settled(256, 21 * MS / 2);
        assert_eq!(size.current(), 146, "256 × 0.6 × 10 / 10.5");
        size.settled(146, 80 * MS);
        assert_eq!(size.current(), 73, "by half at most");
        size.settled(3, MS);
        assert_eq!(
            size.current(),
            73,
            "a partial batch says nothing about a bigger one"
        );
        for _ in 0..10 {
            size.settled(1, 100 * MS);
        }
        assert_eq!(size.current(), 1, "never below one");
    }
}
