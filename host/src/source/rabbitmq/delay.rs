//! Where a message waits for its next try, off its worker: a delay queue of idem's, which
//! the broker dead-letters back into the pipeline's queue when the wait is over.
//!
//! One queue per length of wait, on a grid a quarter apart (`<queue>.idem-delay.<ms>ms`), so
//! every message in a queue waits exactly its queue's time (`x-message-ttl`): no message
//! waits behind a longer one, and a wait lasts between the one asked for and a quarter more.
//! The queues are quorum queues that dead-letter at least once (a message whose wait is over
//! stays until the pipeline's queue has taken it, even while that queue is being declared
//! anew) and survive a broker restart. Each is declared again at every use, and expires
//! when unused for half an hour longer than its wait, after every message in it left.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::Channel;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::AmqpError;
use super::connect::{ACCESS_REFUSED, reply};
use crate::config::{PipelineConfig, RabbitMqConfig};

/// The shortest wait a delay queue serves; a shorter one is no wait at all.
const SHORTEST: Duration = Duration::from_millis(50);

/// The grid's first step and ratio: 100 ms, 125 ms, 156 ms, … each a quarter longer.
const FIRST_STEP_MS: f64 = 100.0;
const STEP_RATIO: f64 = 1.25;

/// How long an unused delay queue outlives its wait.
const KEPT_UNUSED: Duration = Duration::from_secs(30 * 60);

/// The step `wait` is spent in a delay queue of `queues`' for, or `None` when it is spent in
/// the worker: idem declares no queue of `queues` (`declare = false`), or the wait is too
/// short to be worth one. The one place that decides.
pub(super) fn step_for(queues: &RabbitMqConfig, wait: Duration) -> Option<Duration> {
    step(wait).filter(|_| queues.declare)
}

/// The wait on the grid for `wait`: the shortest step at least as long (at most a quarter
/// longer); `None` when `wait` is too short to be worth a queue.
fn step(wait: Duration) -> Option<Duration> {
    if wait < SHORTEST {
        return None;
    }
    let wanted = wait.as_secs_f64() * 1000.0;
    let steps = (wanted / FIRST_STEP_MS).log(STEP_RATIO).ceil().max(0.0);
    // Rounding to whole milliseconds may land a hair under the wait: never shorter.
    let millis = (FIRST_STEP_MS * STEP_RATIO.powf(steps))
        .round()
        .max(wanted.ceil());
    Some(Duration::from_millis(millis as u64))
}

/// The delay queue of `queue` for waits of `step`.
pub(super) fn queue_name(queue: &str, step: Duration) -> String {
    format!("{queue}.idem-delay.{}ms", step.as_millis())
}

/// Declares the delay queue of `queue` for `step` (again, if it exists) on `channel`.
pub(super) async fn declare(
    channel: &Channel,
    queue: &str,
    step: Duration,
) -> Result<String, lapin::Error> {
    let name = queue_name(queue, step);
    channel
        .queue_declare(
            ShortString::from(name.as_str()),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments(queue, step),
        )
        .await?;
    Ok(name)
}

/// Declares the delay queue of a pipeline's first retry wait when the pipeline retries and
/// idem declares its queues, so a user without the permissions for delay queues is told at
/// start, not at a message's retry.
pub(super) async fn declare_first(
    channel: &Channel,
    queues: &RabbitMqConfig,
    pipeline: &PipelineConfig,
) -> Result<(), AmqpError> {
    let retries = pipeline.max_attempts.get() > 1;
    let first = step_for(queues, pipeline.retry.initial).filter(|_| retries);
    let Some(step) = first else {
        return Ok(());
    };
    declare(channel, &queues.queue, step)
        .await
        .map(drop)
        .map_err(|error| refusal(queues, step, error))
}

/// The broker's refusal of a delay queue: the permissions to grant, when it was that.
fn refusal(queues: &RabbitMqConfig, step: Duration, error: lapin::Error) -> AmqpError {
    let name = queue_name(&queues.queue, step);
    match reply(&error) {
        Some((ACCESS_REFUSED, _)) => AmqpError::Refused {
            subject: format!(
                "{}.queue {:?}'s delay queue {name:?}",
                queues.table, queues.queue
            ),
            reason: error.to_string(),
            setting: format!(
                "the permissions of the user in [amqp] url: idem needs configure, write and read on \"{}.idem-delay.*\" for the waits between retries (or set declare = false: waits then hold their worker)",
                queues.queue
            ),
        },
        _ => AmqpError::Topology {
            action: "declare the delay queue",
            queue: name,
            source: error,
        },
    }
}

/// A delay queue's arguments: a quorum queue whose messages all wait `step`, then go back
/// to `queue` at least once.
fn arguments(queue: &str, step: Duration) -> FieldTable {
    let text = |value: &str| AMQPValue::LongString(LongString::from(value));
    let millis = |duration: Duration| AMQPValue::LongLongInt(duration.as_millis() as i64);
    let arguments: BTreeMap<ShortString, AMQPValue> = [
        ("x-queue-type", text("quorum")),
        ("x-message-ttl", millis(step)),
        ("x-expires", millis(step + KEPT_UNUSED)),
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text(queue)),
        ("x-dead-letter-strategy", text("at-least-once")),
        ("x-overflow", text("reject-publish")),
    ]
    .into_iter()
    .map(|(name, value)| (ShortString::from(name), value))
    .collect();
    arguments.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait lands on the first step at least as long, at most a quarter longer; a very
    /// short one needs no queue.
    #[test]
    fn a_wait_lands_on_the_next_step() {
        assert_eq!(step(Duration::from_millis(10)), None);
        for millis in [50, 99, 100, 101, 200, 333, 1_000, 30_000, 3_600_000] {
            let wait = Duration::from_millis(millis);
            let step = step(wait).expect("a step");
            assert!(step >= wait, "{wait:?} → {step:?}");
            assert!(
                step.as_secs_f64() <= (wait.as_secs_f64() * STEP_RATIO).max(0.1) + 0.001,
                "{wait:?} → {step:?}"
            );
        }
        // 100, 125, 156, 195, 244 ms …
        assert_eq!(
            step(Duration::from_millis(190)),
            Some(Duration::from_millis(195))
        );
        assert_eq!(
            step(Duration::from_millis(196)),
            Some(Duration::from_millis(244))
        );
        assert_eq!(
            queue_name("orders", Duration::from_millis(1_526)),
            "orders.idem-delay.1526ms"
        );
    }
}
