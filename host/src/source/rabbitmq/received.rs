//! A delivery from the queue and how it is settled: acked through the channel's ack owner,
//! or copied (a retry, a requeue, a dead letter) on the publishing connection and then acked;
//! a copy the broker will not take while it blocks publishers waits parked, off its worker.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::config::{QueueType, RabbitMqConfig};
use crate::message::InboundMessage;
use crate::source::{Delivery, headers, unix_seconds};

use super::acks::Acks;
use super::delay;
use super::publish::{self, CopyChannel};
use super::publish::{CopyFor, copy_properties, one_copy_at_a_time};
use super::{AmqpError, KIND, Route};

/// A delivery from a pipeline's queue, with what settling it needs.
pub struct Received {
    pub(super) message: InboundMessage,
    pub(super) receipt: Receipt,
    pub(super) route: Arc<Route>,
}

/// A delivery's identity and its channel's ack owner, kept apart from the data the plugin sees.
#[derive(Clone)]
pub struct Receipt {
    acks: Acks,
    pub delivery_tag: u64,
    pub(super) properties: BasicProperties,
    pub(super) body: Vec<u8>,
    /// 1 for a first try, 2 after one retryable failure, …
    pub attempt: u32,
}

impl Delivery for Received {
    fn message(&self) -> &InboundMessage {
        &self.message
    }

    fn attempt(&self) -> u32 {
        self.receipt.attempt
    }

    fn describe(&self) -> String {
        format!("delivery tag {}", self.receipt.delivery_tag)
    }

    async fn ack(&self) -> bool {
        self.receipt.ack().await
    }

    async fn dead_letter(&self, error_kind: &'static str, reason: &str) -> bool {
        self.copied(Copying::DeadLetter {
            error_kind,
            reason: reason.to_string(),
        })
        .await
    }

    /// Waits in a delay queue of idem's, off this worker (see `delay`); with `declare =
    /// false` idem declares nothing, so the wait is spent here, holding the worker.
    async fn retry(&self, attempt: u32, delay: Duration) -> bool {
        let step = delay::step_for(&self.route.queues, delay);
        if step.is_none() {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.route.shutdown.cancelled() => {}
            }
        }
        self.copied(Copying::Retry { attempt, step }).await
    }

    async fn requeue(&self) -> bool {
        self.copied(Copying::Requeue).await
    }

    async fn give_back(&self) -> bool {
        self.receipt.nack_requeue().await
    }
}

/// A copy a delivery settles with.
#[derive(Debug, Clone)]
pub(super) enum Copying {
    DeadLetter {
        error_kind: &'static str,
        reason: String,
    },
    /// Another try, `attempt`, after a wait in the delay queue of `step` (none: at once).
    Retry {
        attempt: u32,
        step: Option<Duration>,
    },
    Requeue,
}

/// Publishes the copy `copying` of the delivery `receipt` stands for, then acks it.
pub(super) async fn copy(
    receipt: &Receipt,
    route: &Route,
    copying: &Copying,
) -> Result<bool, AmqpError> {
    match copying {
        Copying::DeadLetter { error_kind, reason } => {
            receipt
                .dead_letter(
                    &route.copies,
                    &route.pipeline,
                    &route.queues,
                    error_kind,
                    reason,
                )
                .await
        }
        Copying::Retry { attempt, step } => {
            receipt
                .retry(&route.copies, &route.queues.queue, *attempt, *step)
                .await
        }
        Copying::Requeue => receipt.requeue(&route.copies, &route.queues.queue).await,
    }
}

/// How often a parked delivery (see `Received::park`) looks whether the broker lets copies
/// through again.
pub(super) const BLOCKED_LOOK: Duration = Duration::from_secs(1);

impl Received {
    /// Publishes `copying`, then acks the original. While the broker blocks the publishing
    /// connection (a memory or disk alarm), the delivery is parked instead (`park`): its worker
    /// goes on with other messages.
    async fn copied(&self, copying: Copying) -> bool {
        let route = &self.route;
        if route.copies.blocked() {
            return self.park(copying);
        }
        let published = copy(&self.receipt, route, &copying).await;
        if published.is_err() && route.copies.blocked() {
            return self.park(copying);
        }
        self.moved_or_returned(published).await
    }

    /// Keeps the delivery unacked, off its worker, until the broker lets the copy through,
    /// then publishes it and acks the original (a `nack` gives it back if that fails, or
    /// when the host stops first). A `nack` now would bring a poison message straight back
    /// (and count against a quorum queue's delivery limit); holding the worker would let a
    /// few such messages stop the pipeline for the alarm's length. The prefetch bounds how
    /// many are parked.
    fn park(&self, copying: Copying) -> bool {
        let receipt = self.receipt.clone();
        let route = Arc::clone(&self.route);
        tokio::spawn(async move {
            let mut waited = Duration::ZERO;
            while route.copies.blocked() && !route.shutdown.is_cancelled() {
                if waited.as_secs().is_multiple_of(10) {
                    tracing::warn!(queue = %route.queues.queue, waited_s = waited.as_secs(), "RabbitMQ blocks publishing (a memory or disk alarm): a message waits, unacked, to be copied.");
                }
                tokio::select! {
                    () = tokio::time::sleep(BLOCKED_LOOK) => {}
                    () = route.shutdown.cancelled() => {}
                }
                waited += BLOCKED_LOOK;
            }
            let published = if route.shutdown.is_cancelled() {
                Ok(receipt.nack_requeue().await)
            } else {
                copy(&receipt, &route, &copying).await
            };
            if let Err(error) = published {
                tracing::warn!(%error, "Cannot move the message; returning it to its queue.");
                receipt.nack_requeue().await;
            }
        });
        true
    }

    /// The copy's fate; when the copy could not be published, the original goes back with a
    /// `nack` (or, with its channel gone, is redelivered by the broker).
    async fn moved_or_returned(&self, published: Result<bool, AmqpError>) -> bool {
        match published {
            Ok(acked) => acked,
            Err(error) => {
                tracing::warn!(%error, "Cannot move the message; returning it to its queue.");
                self.receipt.nack_requeue().await
            }
        }
    }
}

/// Splits a delivery from `pipeline`'s queue into what the plugin sees and what the host
/// keeps to settle it through `acks`, its channel's ack owner. Call in delivery order.
pub fn receive(
    pipeline: &str,
    queues: &RabbitMqConfig,
    delivery: lapin::message::Delivery,
    acks: &Acks,
) -> (InboundMessage, Receipt) {
    let attempt = header_integer(&delivery.properties, headers::ATTEMPT)
        .and_then(|attempt| u32::try_from(attempt).ok())
        .unwrap_or(1)
        .max(1);
    let counted = queues.queue_type == QueueType::Quorum;
    let message = inbound_message(pipeline, &queues.queue, counted, &delivery);
    (message, Receipt::of(delivery, acks, attempt))
}

/// The header a quorum queue counts a message's earlier deliveries in (absent on the first).
pub(super) const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// What a plugin sees of `delivery`, taken from `queue`: non-text header values rendered as
/// text; the delivery count when the queue keeps one (`counted`: a quorum queue).
pub(super) fn inbound_message(
    pipeline: &str,
    queue: &str,
    counted: bool,
    delivery: &lapin::message::Delivery,
) -> InboundMessage {
    let headers: Vec<(String, String)> = delivery
        .properties
        .headers()
        .as_ref()
        .map(|table| {
            table
                .inner()
                .iter()
                .map(|(name, value)| (name.as_str().to_string(), header_text(value)))
                .collect()
        })
        .unwrap_or_default();
    let earlier = header_integer(&delivery.properties, DELIVERY_COUNT_HEADER)
        .and_then(|count| u32::try_from(count).ok());
    let routing_key = delivery.routing_key.as_str().to_string();
    InboundMessage {
        pipeline: pipeline.to_string(),
        source: KIND.to_string(),
        queue: queue.to_string(),
        subject: routing_key.clone(),
        body: delivery.data.clone(),
        headers,
        message_id: delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_string()),
        redelivered: delivery.redelivered,
        delivery_count: match earlier {
            Some(earlier) => Some(earlier.saturating_add(1)),
            None => counted.then_some(1),
        },
        attributes: attributes(delivery.exchange.as_str(), routing_key),
    }
}

/// What a plugin sees of how a message was routed: `exchange` and `routing-key`.
pub(super) fn attributes(exchange: &str, routing_key: String) -> Vec<(String, String)> {
    vec![
        ("exchange".to_string(), exchange.to_string()),
        ("routing-key".to_string(), routing_key),
    ]
}

/// The attributes of a message published to `routing_key` through the default exchange.
pub fn published_attributes(routing_key: &str) -> Vec<(String, String)> {
    attributes("", routing_key.to_string())
}

impl Receipt {
    /// What settling `delivery` needs, registered with `acks`, its channel's ack owner.
    pub(super) fn of(delivery: lapin::message::Delivery, acks: &Acks, attempt: u32) -> Receipt {
        acks.delivered(delivery.delivery_tag);
        Receipt {
            acks: acks.clone(),
            delivery_tag: delivery.delivery_tag,
            properties: delivery.properties,
            body: delivery.data,
            attempt,
        }
    }

    /// Acks the delivery. `false` means the channel it came on is gone: the broker will
    /// redeliver it, and the claim will make that redelivery a duplicate.
    pub async fn ack(&self) -> bool {
        self.acks.ack(self.delivery_tag).await
    }

    /// Returns the delivery to its queue with a `nack`. Only the last resort: on a quorum
    /// queue every requeue counts against the delivery limit, so a message that is not at
    /// fault is put back with [`Receipt::requeue`] instead.
    pub async fn nack_requeue(&self) -> bool {
        self.acks.nack_requeue(self.delivery_tag).await
    }

    /// Puts the message back at the end of `queue` as it came (same headers and attempt):
    /// publishes a copy, waits for the broker's confirm, then acks the original. Unlike a
    /// `nack`, this does not count as a delivery towards a quorum queue's delivery limit.
    pub async fn requeue(&self, channel: &CopyChannel, queue: &str) -> Result<bool, AmqpError> {
        let headers = self.properties.headers().clone().unwrap_or_default();
        self.put_back(channel, queue, headers).await
    }

    /// Publishes a copy to `dead_letter_queue` with the reason in its headers, waits for the
    /// broker's confirm, then acks the original.
    pub async fn dead_letter(
        &self,
        channel: &CopyChannel,
        pipeline: &str,
        queues: &RabbitMqConfig,
        error_kind: &str,
        reason: &str,
    ) -> Result<bool, AmqpError> {
        let mut headers = self.headers_kept(headers::is_kept_on_a_dead_letter);
        let rejection = headers::Rejection {
            error_kind,
            reason,
            pipeline,
            queue: &queues.queue,
        };
        for (name, value) in rejection.headers() {
            headers.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
        headers.insert(
            ShortString::from(headers::REJECTED_AT),
            AMQPValue::Timestamp(unix_seconds()),
        );
        headers.insert(
            ShortString::from(headers::DEAD_LETTER_ID),
            AMQPValue::LongString(LongString::from(hex::encode(rand::random::<[u8; 12]>()))),
        );
        self.publish_copy(
            channel,
            &queues.dead_letter_queue,
            headers,
            CopyFor::DeadLetter,
        )
        .await?;
        Ok(self.ack().await)
    }

    /// The delivery's headers whose names `keep` takes.
    pub(super) fn headers_kept(&self, keep: impl Fn(&str) -> bool) -> FieldTable {
        let mut kept = FieldTable::default();
        for (name, value) in self.properties.headers().iter().flat_map(FieldTable::inner) {
            if keep(name.as_str()) {
                kept.insert(name.clone(), value.clone());
            }
        }
        kept
    }

    /// Publishes a copy with `attempt` in its headers back to the pipeline's `queue`, or,
    /// after a wait of `step`, to the delay queue that returns it there; waits for the
    /// broker's confirm, then acks the original.
    pub async fn retry(
        &self,
        channel: &CopyChannel,
        queue: &str,
        attempt: u32,
        step: Option<Duration>,
    ) -> Result<bool, AmqpError> {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(
            ShortString::from(headers::ATTEMPT),
            AMQPValue::LongLongInt(i64::from(attempt)),
        );
        let Some(step) = step else {
            return self.put_back(channel, queue, headers).await;
        };
        let waiting = delay::declare(&channel.channel, queue, step)
            .await
            .map_err(|error| AmqpError::Publish {
                queue: delay::queue_name(queue, step),
                reason: format!("cannot declare the delay queue: {error}"),
            })?;
        self.publish_copy(channel, &waiting, headers, CopyFor::Delay)
            .await?;
        Ok(self.ack().await)
    }

    /// Publishes a copy to `queue` with `headers`, waits for the broker's confirm, then acks
    /// the original.
    async fn put_back(
        &self,
        channel: &CopyChannel,
        queue: &str,
        headers: FieldTable,
    ) -> Result<bool, AmqpError> {
        self.publish_copy(channel, queue, headers, CopyFor::Requeue)
            .await?;
        Ok(self.ack().await)
    }

    pub(super) async fn publish_copy(
        &self,
        channel: &CopyChannel,
        queue: &str,
        headers: FieldTable,
        copy: CopyFor,
    ) -> Result<(), AmqpError> {
        let publish_error = |reason: String| AmqpError::Publish {
            queue: queue.to_string(),
            reason,
        };
        let properties = copy_properties(&self.properties, headers, copy);
        // One mandatory copy in flight at a time: a returned (unroutable) message then
        // belongs to the one publish awaiting its confirm, never to another worker's.
        // Bounded like the confirm: while a blocked broker holds one copy, the others give
        // their messages back instead of queueing behind it.
        let _one_copy_at_a_time = one_copy_at_a_time(channel).await.map_err(publish_error)?;
        publish::confirmed(&channel.channel, "", queue, &self.body, properties)
            .await
            .map_err(|unconfirmed| {
                publish_error(match unconfirmed {
                    publish::Unconfirmed::Returned => {
                        "the queue does not exist (message returned)".into()
                    }
                    other => other.to_string(),
                })
            })
    }
}

pub(super) fn header_integer(properties: &BasicProperties, name: &str) -> Option<i64> {
    let value = properties.headers().as_ref()?.inner().get(name)?;
    match value {
        AMQPValue::ShortShortInt(integer) => Some(i64::from(*integer)),
        AMQPValue::ShortShortUInt(integer) => Some(i64::from(*integer)),
        AMQPValue::ShortInt(integer) => Some(i64::from(*integer)),
        AMQPValue::ShortUInt(integer) => Some(i64::from(*integer)),
        AMQPValue::LongInt(integer) => Some(i64::from(*integer)),
        AMQPValue::LongUInt(integer) => Some(i64::from(*integer)),
        AMQPValue::LongLongInt(integer) => Some(*integer),
        AMQPValue::Timestamp(seconds) => i64::try_from(*seconds).ok(),
        AMQPValue::LongString(text) => std::str::from_utf8(text.as_bytes()).ok()?.parse().ok(),
        _ => None,
    }
}

pub(super) fn header_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(text) => String::from_utf8_lossy(text.as_bytes()).into_owned(),
        AMQPValue::ShortString(text) => text.as_str().to_string(),
        AMQPValue::Boolean(flag) => flag.to_string(),
        AMQPValue::ShortShortInt(integer) => integer.to_string(),
        AMQPValue::ShortShortUInt(integer) => integer.to_string(),
        AMQPValue::ShortInt(integer) => integer.to_string(),
        AMQPValue::ShortUInt(integer) => integer.to_string(),
        AMQPValue::LongInt(integer) => integer.to_string(),
        AMQPValue::LongUInt(integer) => integer.to_string(),
        AMQPValue::LongLongInt(integer) => integer.to_string(),
        AMQPValue::Float(float) => float.to_string(),
        AMQPValue::Double(float) => float.to_string(),
        AMQPValue::Timestamp(seconds) => seconds.to_string(),
        AMQPValue::Void => String::new(),
        other => format!("{other:?}"),
    }
}
