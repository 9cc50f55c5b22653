//! The `[pipelines.<name>.retry]` table: how long a message waits between tries when its
//! plugin says the failure is retryable (how many tries: the pipeline's `max_attempts`).

use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::text::{Table, duration, duration_option, duration_schema};
use crate::backoff::{Schedule, jittered};

/// The `[pipelines.<name>.retry]` table.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// The wait before the second try (default `200ms`).
    #[serde(default = "default_initial", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub initial: Duration,
    /// The longest wait (default `10s`, or `initial` when that is longer).
    #[serde(default, deserialize_with = "duration_option")]
    #[schemars(schema_with = "duration_schema")]
    pub max: Option<Duration>,
    /// Each wait is the one before times this (default 2; 1 keeps every wait `initial`).
    #[serde(default = "default_multiplier")]
    pub multiplier: f64,
    /// The share of each wait that may be cut at random, from 0 (none) to 1 (default 0.2:
    /// a wait lasts 80 to 100 % of its length), so messages that failed together are not
    /// tried again together.
    #[serde(default = "default_jitter")]
    pub jitter: f64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            initial: default_initial(),
            max: None,
            multiplier: default_multiplier(),
            jitter: default_jitter(),
        }
    }
}

impl RetryConfig {
    /// The table as written (or the defaults), checked.
    pub(super) fn checked(
        table: Option<Spanned<RetryConfig>>,
        pipeline: &Table,
    ) -> Result<RetryConfig, ConfigError> {
        let Some(table) = table else {
            return Ok(RetryConfig::default());
        };
        let span = Some(table.span());
        let retry = table.into_inner();
        let problem = if retry.initial.is_zero() {
            Some(("retry.initial", "must be longer than 0s".to_string()))
        } else if let Some(max) = retry.max.filter(|max| *max < retry.initial) {
            Some((
                "retry.max",
                format!(
                    "{max:?} is shorter than retry.initial ({:?})",
                    retry.initial
                ),
            ))
        } else if !(1.0..=100.0).contains(&retry.multiplier) {
            Some((
                "retry.multiplier",
                format!("{} is not between 1 and 100", retry.multiplier),
            ))
        } else if !(0.0..=1.0).contains(&retry.jitter) {
            Some((
                "retry.jitter",
                format!("{} is not between 0 and 1", retry.jitter),
            ))
        } else {
            None
        };
        match problem {
            Some((key, problem)) => Err(pipeline.at(span, key, problem)),
            None => Ok(retry),
        }
    }

    /// The longest wait.
    pub fn max(&self) -> Duration {
        self.max.unwrap_or(DEFAULT_MAX.max(self.initial))
    }

    /// The wait before try `attempt` (2 for the first retry), jittered.
    pub fn delay(&self, attempt: u32) -> Duration {
        let schedule = Schedule::new(self.initial, self.max()).multiplied_by(self.multiplier);
        jittered(schedule.delay(attempt.saturating_sub(1)), self.jitter)
    }
}

fn default_initial() -> Duration {
    Duration::from_millis(200)
}

/// The longest wait unless `max` says otherwise.
const DEFAULT_MAX: Duration = Duration::from_secs(10);

fn default_multiplier() -> f64 {
    2.0
}

fn default_jitter() -> f64 {
    0.2
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without jitter the waits grow by the multiplier up to the cap; with it, each is cut
    /// by at most its share.
    #[test]
    fn waits_grow_then_cap_and_jitter_only_shortens() {
        let exact = RetryConfig {
            initial: Duration::from_secs(1),
            max: Some(Duration::from_secs(30)),
            multiplier: 3.0,
            jitter: 0.0,
        };
        let waits: Vec<u64> = (2..=7)
            .map(|attempt| exact.delay(attempt).as_secs())
            .collect();
        assert_eq!(waits, [1, 3, 9, 27, 30, 30]);
        // Without max, the longest wait is 10 s, or initial when that is longer.
        let long = RetryConfig {
            initial: Duration::from_secs(30),
            jitter: 0.0,
            ..RetryConfig::default()
        };
        assert_eq!(long.delay(5), Duration::from_secs(30));
        let defaults = RetryConfig::default();
        for attempt in 2..=20 {
            let ceiling = RetryConfig {
                jitter: 0.0,
                ..defaults
            }
            .delay(attempt);
            let wait = defaults.delay(attempt);
            assert!(
                wait <= ceiling && wait >= ceiling.mul_f64(0.8),
                "{wait:?} vs {ceiling:?}"
            );
        }
    }
}
