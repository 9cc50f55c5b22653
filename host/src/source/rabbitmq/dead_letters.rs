//! A RabbitMQ pipeline's dead-letter queue, read for [`source::dead_letters`](super::super::dead_letters).
//!
//! AMQP 0-9-1 has no way to read a queue without taking its messages, so a pass takes every
//! message that was waiting when it began (`basic.get`, unacked) and gives back the ones it
//! keeps, in their order. On a classic queue they go back at the end with `basic.nack`
//! (requeue), oldest first, to their places. On a quorum queue a `nack` counts as a delivery,
//! and past the queue's delivery limit (20 by default from RabbitMQ 4.0) the broker drops the
//! message: looking would destroy dead letters. There each kept message is renewed at once
//! instead: a copy published to the end of the queue (confirmed), then the original acked,
//! which counts nothing and holds nothing in memory. A replayed message is published to the
//! pipeline's queue, confirmed by the broker, and only then acked out of the dead-letter
//! queue. A pass stops at `SCAN_MESSAGES` messages, or, on a classic queue, when the messages
//! it holds reach `SCAN_BYTES`; it says so.

use lapin::Channel;
use lapin::options::{BasicGetOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use sha2::{Digest, Sha256};
use tracing::warn;

use crate::config::{PipelineConfig, QueueType, RabbitMqConfig};
use crate::message::InboundMessage;
use crate::source::dead_letters::{Action, DeadLetter, SCAN_MESSAGES, Selection, Walk};
use crate::source::headers;

use super::publish::CopyChannel;
use super::publish::CopyFor;
use super::received::DELIVERY_COUNT_HEADER;
use super::received::inbound_message;
use super::{AmqpError, Receipt, connect_channel, topology};

/// The bodies one pass over a classic queue holds (unacked, to give back in order) at most.
pub const SCAN_BYTES: usize = 64 << 20;

/// Goes once through the messages waiting in `pipeline`'s dead-letter queue, calls `seen`
/// with each selected one (in queue order), replays or discards it if `action` says so, and returns the
/// rest to the queue in their order. Returns how many were selected.
pub async fn pass(
    queues: &RabbitMqConfig,
    pipeline: &PipelineConfig,
    selection: &Selection,
    action: Action,
    seen: impl FnMut(&DeadLetter),
) -> Result<u64, AmqpError> {
    let queue = &queues.dead_letter_queue;
    let (connection, channel) = connect_channel(&queues.broker, "dlq").await?;
    let acks = super::Acks::spawn(channel.clone());
    let waiting = prepare(&channel, queues).await?;
    let copies = CopyChannel::unwatched(channel.clone());
    // A quorum queue counts every `nack` against its delivery limit: kept messages are
    // renewed at once (see the module's words) rather than held and given back.
    let renew = queues.queue_type == QueueType::Quorum;
    let mut kept = Vec::new();
    let mut held_bytes = 0;
    let mut walk = Walk::new(selection, seen);
    let mut outcome = Ok(());
    for position in 1..=u64::from(waiting) {
        if walk.is_done() {
            break;
        }
        if position > SCAN_MESSAGES || held_bytes >= SCAN_BYTES {
            warn!(
                pipeline = %pipeline.name,
                queue = %queue,
                read = position - 1,
                waiting,
                "The dead-letter pass stopped before the end of the queue (it reads at most {SCAN_MESSAGES} messages, and holds at most {SCAN_BYTES} bytes of a classic queue's); narrow it with --kind, --reason or --since, or replay what it found first."
            );
            break;
        }
        let (letter, receipt) = match next(&channel, queue, pipeline, position, &acks).await {
            Ok(Some(next)) => next,
            Ok(None) => break,
            Err(error) => {
                outcome = Err(error);
                break;
            }
        };
        let keep = !walk.take(&letter) || action == Action::Look;
        if keep {
            if !renew {
                held_bytes += receipt.body.len();
                kept.push(receipt);
            } else if let Err(error) = receipt.requeue(&copies, queue).await {
                // Not renewed: the channel's close gives it back.
                outcome = Err(error);
                break;
            }
            continue;
        }
        let removed = match action {
            Action::Discard => discard(&receipt, queues).await,
            _ => replay(&copies, &receipt, &letter, queues).await,
        };
        if let Err(error) = removed {
            kept.push(receipt);
            outcome = Err(error);
            break;
        }
    }
    // Oldest first, so the queue keeps its order (a classic queue's; a quorum queue's kept
    // messages were renewed already).
    for receipt in kept {
        receipt.nack_requeue().await;
    }
    let _ = connection.close(200, ShortString::from("dlq done")).await;
    outcome.map(|()| walk.selected())
}

/// Puts `channel` in confirm mode (a replay waits for its copy's confirm) and returns how
/// many messages wait in `queues`' dead-letter queue now: only those are read, so a message
/// dead-lettered again while the pass runs is not met twice.
async fn prepare(channel: &Channel, queues: &RabbitMqConfig) -> Result<u32, AmqpError> {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|source| AmqpError::Topology {
            action: "enable publisher confirms for replay into",
            queue: queues.queue.clone(),
            source,
        })?;
    let declared = topology::inspect(channel, &queues.dead_letter_queue)
        .await
        .map_err(|source| AmqpError::Topology {
            action: "inspect",
            queue: queues.dead_letter_queue.clone(),
            source,
        })?;
    Ok(declared.message_count())
}

/// Takes the next message of dead-letter queue `queue` (unacked), as the dead letter at
/// `position` and what settles it; `None` when the queue is empty.
async fn next(
    channel: &Channel,
    queue: &str,
    pipeline: &PipelineConfig,
    position: u64,
    acks: &super::Acks,
) -> Result<Option<(DeadLetter, Receipt)>, AmqpError> {
    let got = channel
        .basic_get(ShortString::from(queue), BasicGetOptions { no_ack: false })
        .await
        .map_err(|source| AmqpError::Topology {
            action: "read from",
            queue: queue.to_string(),
            source,
        })?;
    let Some(got) = got else {
        return Ok(None);
    };
    let delivery = got.delivery;
    // The message as the pipeline's plugin saw it: from the pipeline's queue.
    let message = inbound_message(&pipeline.name, pipeline.queue(), false, &delivery);
    let id = digest(&message);
    let letter = DeadLetter::recorded(position, id, message);
    Ok(Some((letter, Receipt::of(delivery, acks, 1))))
}

/// Replays `letter`: a copy on the pipeline's queue, confirmed, then the dead letter acked.
async fn replay(
    channel: &CopyChannel,
    receipt: &Receipt,
    letter: &DeadLetter,
    queues: &RabbitMqConfig,
) -> Result<(), AmqpError> {
    let headers = replay_headers(receipt, letter.replays + 1);
    receipt
        .publish_copy(channel, &queues.queue, headers, CopyFor::Requeue)
        .await?;
    if !receipt.ack().await {
        return Err(AmqpError::Publish {
            queue: queues.dead_letter_queue.clone(),
            reason: "the dead letter was copied but could not be acked; it may be replayed twice (harmless: the claim dedups)".into(),
        });
    }
    Ok(())
}

/// Discards `receipt`'s dead letter: acked out of the queue, for good.
async fn discard(receipt: &Receipt, queues: &RabbitMqConfig) -> Result<(), AmqpError> {
    if receipt.ack().await {
        return Ok(());
    }
    Err(AmqpError::Publish {
        queue: queues.dead_letter_queue.clone(),
        reason: "the dead letter could not be acked (the channel closed): it is still there".into(),
    })
}

/// The original headers without the host's diagnostics of the last failure, with the replay
/// count: retries start over in the pipeline.
fn replay_headers(receipt: &Receipt, replays: u64) -> FieldTable {
    let mut headers = receipt.headers_kept(|name| !headers::is_diagnostic(name));
    headers.insert(
        ShortString::from(headers::REPLAYS),
        AMQPValue::LongLongInt(i64::try_from(replays).unwrap_or(i64::MAX)),
    );
    headers
}

/// The id of a dead letter: a digest of what it holds, its headers (the random
/// `x-idem-dead-letter-id` the host gives what it dead-letters among them, so that two
/// identical messages are two dead letters) and its body, but not the count the broker keeps
/// of its deliveries. Nothing a producer sets can make it another dead letter's id without
/// being that same message.
fn digest(message: &InboundMessage) -> String {
    let mut hasher = Sha256::new();
    for (name, value) in &message.headers {
        if name == DELIVERY_COUNT_HEADER {
            continue;
        }
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(value.as_bytes());
        hasher.update([0]);
    }
    hasher.update(&message.body);
    hex::encode(&hasher.finalize()[..12])
}
