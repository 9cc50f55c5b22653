//! How long to wait before trying again, everywhere the host tries again: reconnects,
//! transient database errors, a message's retryable failures, an outbox row's deliveries.
//! One [`Schedule`] (doubling from a first wait up to a cap), waited out exactly or with
//! jitter through a [`Backoff`].

use std::time::Duration;

use rand::Rng;

/// Waits that double from `first` up to `max`: the n-th wait (from 1) is
/// `first × 2^(n−1)`, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub first: Duration,
    pub max: Duration,
}

impl Schedule {
    pub const fn new(first: Duration, max: Duration) -> Schedule {
        Schedule { first, max }
    }

    /// The `nth` wait (1 for the first; 0 counts as the first).
    pub fn delay(&self, nth: u32) -> Duration {
        let doublings = nth.saturating_sub(1).min(20);
        let factor = 1u32.checked_shl(doublings).unwrap_or(u32::MAX);
        self.first.saturating_mul(factor).min(self.max)
    }
}

/// A [`Schedule`] walked one wait at a time, each wait jittered (uniform in its upper half)
/// so clients that failed together do not come back together.
#[derive(Debug, Clone)]
pub struct Backoff {
    schedule: Schedule,
    /// Waits handed out since the last success.
    waits: u32,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            schedule: Schedule::new(first, max),
            waits: 0,
        }
    }

    /// The next delay: uniform in [ceiling / 2, ceiling], where the ceiling is the schedule's
    /// next wait.
    pub fn next_delay(&mut self) -> Duration {
        self.waits = self.waits.saturating_add(1);
        let ceiling = self.schedule.delay(self.waits);
        let half = ceiling / 2;
        half + rand::rng().random_range(Duration::ZERO..=half)
    }

    /// Starts over after a success.
    pub fn reset(&mut self) {
        self.waits = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_doubles_then_caps() {
        let schedule = Schedule::new(Duration::from_secs(1), Duration::from_secs(300));
        let waits: Vec<u64> = [0, 1, 2, 5, 9, 10, 30, u32::MAX]
            .into_iter()
            .map(|nth| schedule.delay(nth).as_secs())
            .collect();
        assert_eq!(waits, [1, 1, 2, 16, 256, 300, 300, 300]);
    }

    #[test]
    fn backoff_grows_then_caps_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let delays: Vec<Duration> = (0..8).map(|_| backoff.next_delay()).collect();
        let ceilings = [100, 200, 400, 800, 1000, 1000, 1000, 1000];
        for (delay, ceiling) in delays.iter().zip(ceilings) {
            let ceiling = Duration::from_millis(ceiling);
            assert!(
                *delay >= ceiling / 2 && *delay <= ceiling,
                "{delay:?} vs {ceiling:?}"
            );
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
