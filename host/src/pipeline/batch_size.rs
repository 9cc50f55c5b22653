//! How many messages a worker gathers into one transaction: `batch.size`, or, with
//! `batch.latency` set, a size that follows the load so nearly every message (its p99)
//! settles within that long.
//!
//! After each batch, its duration (from the moment a worker took its first delivery to its
//! last settlement: lingering, the plugin calls, waiting for the database and the acks
//! included; not the wait for a free worker, which is waiting in the queue and which a
//! smaller batch would not shorten) divided by its messages is one sample of what a message
//! costs in a batch of about that size. The size is what fits `AIM` of the target at the
//! smoothed cost (an exponentially weighted mean, `SMOOTHING`): a fixed cost per batch (round
//! trips, the commit) makes small batches look dear per message, so the size climbs to where
//! a batch takes `AIM` of the target and stays there, without a ratchet that any lucky fast
//! batch would push up; a full batch under the aim grows it by one at least, so a large fixed
//! cost does not hold it at 1, and one over the aim never grows it. Batch durations at one
//! size spread: on a loaded two-core machine the
//! slowest in a hundred takes about twice the typical one, so `AIM` is half the target. The
//! size moves by a quarter up and by half down at most per batch (one slow batch, a retry
//! say, does not undo it), starts at 1, stays between 1 and `batch.size`, and is shared by
//! the pipeline's workers. A batch that was not full (the source had no more) and took less
//! than the target says nothing about a bigger one and leaves it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::config::BatchConfig;

/// The share of the target a typical batch aims at.
const AIM: f64 = 0.5;
/// The weight of the newest batch in the smoothed cost of a message.
const SMOOTHING: f64 = 0.25;

/// A pipeline's batch size, fixed or adapting (see the module).
#[derive(Debug)]
pub struct BatchSize {
    max: usize,
    target: Option<Duration>,
    current: AtomicUsize,
    /// The smoothed seconds a message costs in a batch, once a batch has told.
    per_message: Mutex<Option<f64>>,
}

impl BatchSize {
    pub fn new(config: &BatchConfig) -> BatchSize {
        let max = config.size.get();
        let start = if config.latency.is_some() { 1 } else { max };
        BatchSize {
            max,
            target: config.latency,
            current: AtomicUsize::new(start),
            per_message: Mutex::new(None),
        }
    }

    /// The most messages the next batch gathers.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// A batch of `messages` settled `took` after its first delivery arrived. Returns the
    /// new size when it changed (never without `batch.latency`).
    pub fn settled(&self, messages: usize, took: Duration) -> Option<usize> {
        let target = self.target?;
        let current = self.current();
        if messages == 0 || (messages < current && took <= target) {
            return None;
        }
        let sample = took.as_secs_f64() / messages as f64;
        let per_message = {
            let mut smoothed = self.per_message.lock().unwrap_or_else(|e| e.into_inner());
            let next = match *smoothed {
                Some(before) => before + SMOOTHING * (sample - before),
                None => sample,
            };
            *smoothed = Some(next);
            next
        };
        let aim = AIM * target.as_secs_f64();
        let fits = (aim / per_message.max(f64::MIN_POSITIVE)) as usize;
        let next = if took.as_secs_f64() <= aim {
            // Under the aim: one more at least, even where the fixed cost makes the smoothed
            // cost say no bigger batch fits (several workers' batches at once, a far database).
            fits.clamp(current + 1, current + (current / 4).max(1))
        } else {
            fits.clamp(current / 2, current)
        };
        let next = next.clamp(1, self.max);
        self.current.store(next, Ordering::Relaxed);
        (next != current).then_some(next)
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
        assert_eq!(size.settled(64, 500 * MS), None, "nothing changed");
        assert_eq!(size.current(), 64);
    }

    /// Batches whose duration grows with their size (1 ms plus 0.1 ms a message).
    fn cost(messages: usize) -> Duration {
        MS + MS / 10 * messages as u32
    }

    /// Runs `batches` full batches, each taking `cost` of its size, then checks the size
    /// settled within `expected`.
    fn settles_within(
        size: &BatchSize,
        batches: usize,
        cost: impl Fn(usize) -> Duration,
        expected: std::ops::RangeInclusive<usize>,
    ) {
        for _ in 0..batches {
            let messages = size.current();
            size.settled(messages, cost(messages));
        }
        assert!(
            expected.contains(&size.current()),
            "settled at {}, a batch of which takes {:?}",
            size.current(),
            cost(size.current())
        );
    }

    /// The size climbs from 1 to where a batch takes half the target (40 messages: 5 ms),
    /// never past `size`.
    #[test]
    fn the_size_settles_where_a_batch_takes_half_the_target() {
        let size = sizer(256, Some(10 * MS));
        assert_eq!(size.current(), 1);
        settles_within(&size, 100, cost, 38..=42);
        let cheap = sizer(256, Some(10 * MS));
        for _ in 0..200 {
            cheap.settled(cheap.current(), MS);
        }
        assert_eq!(cheap.current(), 256, "bounded by batch.size");
    }

    /// Durations that swing a third either way around the typical one: the size stays near
    /// where the typical batch takes half the target instead of climbing on every lucky
    /// batch until an unlucky one stops it.
    #[test]
    fn noise_does_not_ratchet_the_size_up() {
        let size = sizer(1024, Some(10 * MS));
        let mut sizes = Vec::new();
        for batch in 0..2_000u32 {
            let messages = size.current();
            let swing = [2, 3, 4][batch as usize % 3];
            size.settled(messages, cost(messages) * swing / 3);
            if batch >= 100 {
                sizes.push(size.current());
            }
        }
        let mean = sizes.iter().sum::<usize>() as f64 / sizes.len() as f64;
        assert!((34.0..=46.0).contains(&mean), "mean size {mean}");
    }

    /// Batches that spread as on a loaded machine (one in fifty takes 1.8 times as long, one
    /// in two hundred 2.5 times): once the size has settled, 99 of 100 batches stay under the
    /// target.
    #[test]
    fn the_tail_of_the_batches_stays_under_the_target() {
        let size = sizer(1024, Some(10 * MS));
        let mut durations = Vec::new();
        for batch in 0..5_000 {
            let messages = size.current();
            let took = match batch % 200 {
                0 => cost(messages) * 5 / 2,
                50 | 100 | 150 | 199 => cost(messages) * 9 / 5,
                _ => cost(messages),
            };
            size.settled(messages, took);
            if batch >= 1_000 {
                durations.push(took);
            }
        }
        durations.sort();
        let p99 = durations[durations.len() * 99 / 100];
        assert!(p99 <= 10 * MS, "p99 {p99:?}");
    }

    /// A fixed cost of 4 ms a batch (a far database, other workers' batches) and 20 µs a
    /// message: the smoothed cost of a message at size 1 says nothing bigger fits 5 ms, yet
    /// the size climbs to where a batch takes the aim.
    #[test]
    fn a_large_fixed_cost_does_not_hold_the_size_at_one() {
        let size = sizer(256, Some(10 * MS));
        let cost = |messages: usize| 4 * MS + Duration::from_micros(20) * messages as u32;
        settles_within(&size, 300, cost, 45..=52);
    }

    #[test]
    fn a_slow_batch_shrinks_the_size_by_half_at_most_and_a_quick_partial_one_leaves_it() {
        let size = sizer(256, Some(10 * MS));
        for _ in 0..100 {
            size.settled(size.current(), MS);
        }
        assert_eq!(size.current(), 256);
        assert_eq!(size.settled(256, 80 * MS), Some(128), "the new size");
        assert_eq!(size.current(), 128, "by half at most");
        assert_eq!(size.settled(3, MS), None, "nothing changed");
        assert_eq!(
            size.current(),
            128,
            "a partial batch in time says nothing about a bigger one"
        );
        size.settled(3, 30 * MS);
        assert_eq!(size.current(), 64, "a partial batch over the target does");
        for _ in 0..20 {
            size.settled(1, 100 * MS);
        }
        assert_eq!(size.current(), 1, "never below one");
        // Back to where it fits once batches are quick again.
        settles_within(&size, 50, cost, 38..=42);
    }
}
