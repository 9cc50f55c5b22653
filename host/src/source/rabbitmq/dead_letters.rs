//! A pipeline's dead-letter queue as an operator sees it: listed, shown, and replayed by
//! selection (`idem dlq list/show/replay`).
//!
//! AMQP 0-9-1 has no way to read a queue without taking its messages, so a pass takes every
//! message that was waiting when it began (`basic.get`, unacked), and at the end returns the
//! ones it keeps with `basic.nack` (requeue), oldest first: the queue keeps its order and its
//! messages. A replayed message is published to the pipeline's queue, confirmed by the
//! broker, and only then acked out of the dead-letter queue.

use std::time::{Duration, SystemTime};

use lapin::options::{BasicGetOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::{
    AmqpError, Copy, ERROR_KIND_HEADER, REASON_HEADER, REJECTED_AT_HEADER, Receipt,
    connect_channel, header_integer, header_text, inbound_message, topology,
};
use crate::config::{AmqpConfig, PipelineConfig};
use crate::message::InboundMessage;

/// How many times a message has been replayed out of a dead-letter queue.
pub const REPLAYS_HEADER: &str = "x-idem-replays";

/// Which dead letters a command acts on; every given filter must match.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// The error kind (`x-idem-error-kind`), exactly.
    pub kind: Option<String>,
    /// A fragment of the reason (`x-idem-reason`).
    pub reason: Option<String>,
    /// Dead-lettered at most this long ago.
    pub since: Option<Duration>,
    /// Act on at most this many matching messages.
    pub limit: Option<u64>,
}

/// One dead letter as it sits in the queue.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// 1 for the oldest message in the queue when the pass began.
    pub position: u64,
    /// The delivery as the plugin saw it, with every header (the `x-idem-*` ones included).
    pub message: InboundMessage,
    /// The error kind the host recorded, e.g. `invalid-input` or `retries-exhausted`.
    pub kind: Option<String>,
    pub reason: Option<String>,
    /// How long ago it was dead-lettered, when the host recorded it.
    pub age: Option<Duration>,
    /// How many times it was replayed before.
    pub replays: u64,
}

impl Selection {
    fn matches(&self, letter: &DeadLetter) -> bool {
        self.kind
            .as_ref()
            .is_none_or(|kind| letter.kind.as_deref() == Some(kind.as_str()))
            && self.reason.as_ref().is_none_or(|fragment| {
                letter
                    .reason
                    .as_deref()
                    .is_some_and(|reason| reason.contains(fragment.as_str()))
            })
            && self
                .since
                .is_none_or(|since| letter.age.is_some_and(|age| age <= since))
    }
}

/// What a pass does with each selected message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Look only: every message goes back where it was.
    Look,
    /// Move the selected messages to the pipeline's queue.
    Replay,
}

/// Goes once through the messages waiting in `pipeline`'s dead-letter queue, calls `seen`
/// with each selected one (in queue order), replays it if `action` says so, and returns the
/// rest to the queue in their order. Returns how many were selected.
pub async fn pass(
    amqp: Option<&AmqpConfig>,
    pipeline: &PipelineConfig,
    selection: &Selection,
    action: Action,
    mut seen: impl FnMut(&DeadLetter),
) -> Result<u64, AmqpError> {
    let queues = super::queues(pipeline)?;
    let amqp = amqp.ok_or_else(|| AmqpError::NotConfigured {
        pipeline: pipeline.name.clone(),
    })?;
    let queue = &queues.dead_letter_queue;
    let (connection, channel) = connect_channel(amqp, "dlq").await?;
    let acks = super::Acks::spawn(channel.clone());
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|source| AmqpError::Topology {
            action: "enable publisher confirms for replay into",
            queue: queues.queue.clone(),
            source,
        })?;
    // Only what is there now: a message dead-lettered again while this runs is not met twice.
    let waiting = topology::inspect(&channel, queue)
        .await
        .map_err(|source| AmqpError::Topology {
            action: "inspect",
            queue: queue.clone(),
            source,
        })?
        .message_count();
    let mut kept = Vec::new();
    let mut selected = 0;
    let mut outcome = Ok(());
    for position in 1..=u64::from(waiting) {
        if selection.limit.is_some_and(|limit| selected >= limit) {
            break;
        }
        let got = match channel
            .basic_get(
                ShortString::from(queue.as_str()),
                BasicGetOptions { no_ack: false },
            )
            .await
        {
            Ok(Some(got)) => got,
            Ok(None) => break,
            Err(source) => {
                outcome = Err(AmqpError::Topology {
                    action: "read from",
                    queue: queue.clone(),
                    source,
                });
                break;
            }
        };
        let delivery = got.delivery;
        let letter = describe(pipeline, position, &delivery);
        let receipt = Receipt::of(delivery, &acks, 1);
        if !selection.matches(&letter) {
            kept.push(receipt);
            continue;
        }
        selected += 1;
        seen(&letter);
        if action == Action::Look {
            kept.push(receipt);
            continue;
        }
        let headers = replay_headers(&receipt, letter.replays + 1);
        if let Err(error) = receipt
            .publish_copy(&channel, &queues.queue, headers, Copy::Requeue)
            .await
        {
            kept.push(receipt);
            outcome = Err(error);
            break;
        }
        if !receipt.ack().await {
            outcome = Err(AmqpError::Publish {
                queue: queue.clone(),
                reason: "the dead letter was copied but could not be acked; it may be replayed twice (harmless: the claim dedups)".into(),
            });
            break;
        }
    }
    // Oldest first, so the queue keeps its order.
    for receipt in kept {
        receipt.nack_requeue().await;
    }
    let _ = connection.close(200, ShortString::from("dlq done")).await;
    outcome.map(|()| selected)
}

/// The original headers without the host's diagnostics of the last failure, with the replay
/// count: retries start over in the pipeline.
fn replay_headers(receipt: &Receipt, replays: u64) -> FieldTable {
    let mut headers: FieldTable = receipt
        .properties
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .filter(|(name, _)| !name.as_str().starts_with("x-idem-"))
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect::<std::collections::BTreeMap<_, _>>()
                .into()
        })
        .unwrap_or_default();
    headers.insert(
        ShortString::from(REPLAYS_HEADER),
        AMQPValue::LongLongInt(i64::try_from(replays).unwrap_or(i64::MAX)),
    );
    headers
}

fn describe(
    pipeline: &PipelineConfig,
    position: u64,
    delivery: &lapin::message::Delivery,
) -> DeadLetter {
    let properties = &delivery.properties;
    let header = |name: &str| {
        properties
            .headers()
            .as_ref()
            .and_then(|table| table.inner().get(name).map(header_text))
    };
    let age = header_integer(properties, REJECTED_AT_HEADER)
        .and_then(|seconds| u64::try_from(seconds).ok())
        .map(|seconds| {
            let rejected = SystemTime::UNIX_EPOCH + Duration::from_secs(seconds);
            SystemTime::now()
                .duration_since(rejected)
                .unwrap_or_default()
        });
    // The message as the pipeline's plugin saw it: from the pipeline's queue.
    let message = inbound_message(&pipeline.name, pipeline.queue(), false, delivery);
    DeadLetter {
        position,
        message,
        kind: header(ERROR_KIND_HEADER),
        reason: header(REASON_HEADER),
        age,
        replays: header_integer(properties, REPLAYS_HEADER)
            .and_then(|replays| u64::try_from(replays).ok())
            .unwrap_or(0),
    }
}
