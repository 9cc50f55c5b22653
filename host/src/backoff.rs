//! How long to wait before trying again, everywhere the host tries again: reconnects,
//! transient database errors, a message's retryable failures, an outbox row's deliveries.
//! One [`Schedule`] (growing from a first wait, doubling unless told otherwise, up to a cap),
//! waited out exactly, cut by a random share ([`jittered`]), or through a [`Backoff`].

use std::time::Duration;

use rand::Rng;

/// Waits that grow from `first` by `multiplier` up to `max`: the n-th wait (from 1) is
/// `first × multiplier^(n−1)`, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub first: Duration,
    pub max: Duration,
    pub multiplier: f64,
}

impl Schedule {
    /// Waits that double.
    pub const fn new(first: Duration, max: Duration) -> Schedule {
        Schedule {
            first,
            max,
            multiplier: 2.0,
        }
    }

    /// The same, each wait `multiplier` times the one before (at least 1).
    pub fn multiplied_by(self, multiplier: f64) -> Schedule {
        Schedule {
            multiplier: multiplier.max(1.0),
            ..self
        }
    }

    /// The `nth` wait (1 for the first; 0 counts as the first).
    pub fn delay(&self, nth: u32) -> Duration {
        let growths = nth.saturating_sub(1).min(1_000);
        let factor = self.multiplier.powi(growths as i32);
        Duration::try_from_secs_f64(self.first.as_secs_f64() * factor)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

/// `wait` cut by a random share of at most `jitter` (0: exact; 0.2: 80 to 100 % of it), so
/// clients that failed together do not come back together.
pub fn jittered(wait: Duration, jitter: f64) -> Duration {
    let jitter = jitter.clamp(0.0, 1.0);
    if jitter == 0.0 {
        return wait;
    }
    wait.mul_f64(1.0 - rand::rng().random_range(0.0..jitter))
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
