//! RabbitMQ through lapin: connect, declare, consume, dead-letter, acknowledge.
//!
//! Architecture invariant: publishes to the dead-letter or retry queue are confirmed by the
//! broker before the original delivery is acked, so a rejected message is never lost.

mod acks;
pub mod check;
mod connect;
pub mod dead_letters;
pub mod publish;
pub mod topology;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, Consumer};

pub use acks::Acks;
pub use connect::connect;
use topology::Role;

use crate::config::{AmqpConfig, PipelineConfig, QueueType, RabbitMqConfig, SourceConfig};
use crate::message::InboundMessage;
use crate::source::{self, Delivery, Source, SourceError, headers, unix_seconds};
use publish::CopyChannel;

/// The source kind a plugin sees in `message.source`.
pub const KIND: &str = SourceConfig::RABBITMQ;

/// AMQP persistent delivery mode.
const PERSISTENT: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    #[error("cannot reach RabbitMQ at {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: lapin::Error,
    },
    #[error("RabbitMQ at {endpoint} did not answer within {after:?}")]
    Timeout { endpoint: String, after: Duration },
    /// A refusal no retry can fix: the operator must change `setting`.
    #[error("RabbitMQ refused {subject}: {reason}; check {setting}")]
    Refused {
        subject: String,
        reason: String,
        setting: String,
    },
    #[error("RabbitMQ refused to {action} {queue:?}: {source}")]
    Topology {
        action: &'static str,
        queue: String,
        source: lapin::Error,
    },
    #[error("publish to {queue:?} failed: {reason}")]
    Publish { queue: String, reason: String },
    #[error("the consumer on {queue:?} ended: {reason}")]
    ConsumerLost { queue: String, reason: String },
}

impl AmqpError {
    /// Whether the operator must change the configuration: retrying cannot help.
    pub fn is_refused(&self) -> bool {
        matches!(self, AmqpError::Refused { .. })
    }
}

/// One pipeline's connections to the broker: a channel consuming its queue, and, on a
/// connection of its own, a channel in confirm mode for the copies (dead letters, retries,
/// requeues). Apart, because the broker stops reading from a connection that publishes
/// during a memory or disk alarm: the consumer's acks keep flowing while a copy waits.
pub struct Session {
    connection: Connection,
    publisher: Connection,
    consumer: Consumer,
    consumer_tag: String,
    /// The owner of the channel's acks.
    acks: Acks,
    route: Arc<Route>,
}

/// Where a pipeline's copies (dead letters, retries, requeues) go, and the channels.
struct Route {
    /// The consumer's channel.
    channel: Channel,
    /// The copies' channel, in confirm mode, on the publishing connection.
    copies: CopyChannel,
    pipeline: String,
    queues: RabbitMqConfig,
    /// Ends a retry's wait when the host stops.
    shutdown: CancellationToken,
}

/// A delivery from a pipeline's queue, with what settling it needs.
pub struct Received {
    message: InboundMessage,
    receipt: Receipt,
    route: Arc<Route>,
}

/// A delivery's identity and its channel's ack owner, kept apart from the data the plugin sees.
#[derive(Clone)]
pub struct Receipt {
    acks: Acks,
    pub delivery_tag: u64,
    properties: BasicProperties,
    body: Vec<u8>,
    /// 1 for a first try, 2 after one retryable failure, …
    pub attempt: u32,
}

impl Session {
    /// Connects, makes sure the queue and its dead-letter queue are there as configured, and
    /// starts consuming.
    pub async fn open(
        queues: &RabbitMqConfig,
        pipeline: &PipelineConfig,
        shutdown: &CancellationToken,
    ) -> Result<Session, AmqpError> {
        // Named so an operator (or a fault test) can tell which host and queue a
        // connection serves: `idem loyalty on order-completed (pid 4242)`.
        let name = format!(
            "idem {} on {} (pid {})",
            pipeline.name,
            queues.queue,
            std::process::id()
        );
        let connection = connect(&queues.broker, name.clone()).await?;
        let consumed = Self::consume(
            &connection,
            &pipeline.name,
            queues,
            pipeline.effective_prefetch(),
        )
        .await;
        let opened = match consumed {
            Ok(consuming) => Self::copies(&queues.broker, &name, queues)
                .await
                .map(|copies| (consuming, copies)),
            Err(error) => Err(error),
        };
        match opened {
            Ok(((channel, consumer, consumer_tag), (publisher, copies))) => Ok(Session {
                connection,
                acks: Acks::spawn(channel.clone()),
                route: Arc::new(Route {
                    channel,
                    copies: CopyChannel::watched(copies, publisher.status().clone()),
                    pipeline: pipeline.name.clone(),
                    queues: queues.clone(),
                    shutdown: shutdown.clone(),
                }),
                consumer,
                consumer_tag,
                publisher,
            }),
            Err(error) => {
                let _ = connection
                    .close(200, ShortString::from("idem stopping"))
                    .await;
                Err(error)
            }
        }
    }

    /// The publishing connection and its channel in confirm mode, for the copies.
    async fn copies(
        broker: &AmqpConfig,
        name: &str,
        queues: &RabbitMqConfig,
    ) -> Result<(Connection, Channel), AmqpError> {
        let publisher = connect(broker, format!("{name} (copies)")).await?;
        let failed =
            |action| move |source| topology::refusal(queues, Role::DeadLetter, action, source);
        let channel = match publisher.create_channel().await {
            Ok(channel) => channel,
            Err(source) => {
                let _ = publisher
                    .close(200, ShortString::from("idem stopping"))
                    .await;
                return Err(failed("open a channel for")(source));
            }
        };
        if let Err(source) = channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
        {
            let _ = publisher
                .close(200, ShortString::from("idem stopping"))
                .await;
            return Err(failed("enable publisher confirms on")(source));
        }
        Ok((publisher, channel))
    }

    async fn consume(
        connection: &Connection,
        pipeline: &str,
        queues: &RabbitMqConfig,
        prefetch: u16,
    ) -> Result<(Channel, Consumer, String), AmqpError> {
        topology::ensure(connection, queues, Role::Consumed, true).await?;
        topology::ensure(connection, queues, Role::DeadLetter, true).await?;
        let failed =
            |action| move |source| topology::refusal(queues, Role::Consumed, action, source);
        let channel = connection
            .create_channel()
            .await
            .map_err(failed("open a channel for"))?;
        // Nothing is published on it (copies go on `Route::copies`): no confirm mode.
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(failed("set prefetch on"))?;
        let consumer_tag = format!("idem-{}-{}", pipeline, std::process::id());
        let consumer = channel
            .basic_consume(
                ShortString::from(queues.queue.as_str()),
                ShortString::from(consumer_tag.as_str()),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(failed("consume from"))?;
        Ok((channel, consumer, consumer_tag))
    }

    /// Stops new deliveries; deliveries already received stay ackable.
    pub async fn cancel(&self) {
        if let Err(error) = self
            .route
            .channel
            .basic_cancel(
                ShortString::from(self.consumer_tag.as_str()),
                BasicCancelOptions::default(),
            )
            .await
        {
            tracing::debug!(%error, "Cancelling the consumer failed; closing the connection anyway.");
        }
    }

    /// Closes the connection; unacked deliveries return to their queue.
    /// Bounded by `CLOSE_WAIT` each: a connection the broker dropped while it sat idle (the
    /// publishing one, after a broker restart) may never answer its close, and the consume
    /// loop reconnects only once this returns.
    pub async fn close(self) {
        for connection in [&self.connection, &self.publisher] {
            let close = connection.close(200, ShortString::from("idem stopping"));
            match tokio::time::timeout(CLOSE_WAIT, close).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, "Closing a RabbitMQ connection failed.");
                }
                Err(_) => {
                    tracing::debug!("A RabbitMQ connection did not answer its close; dropped.");
                }
            }
        }
    }
}

/// How long closing a connection waits for the broker's answer.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

impl Source for Session {
    type Config = RabbitMqConfig;
    type Delivery = Received;
    const BROKER: &'static str = "RabbitMQ";

    async fn open(
        queues: &RabbitMqConfig,
        pipeline: &PipelineConfig,
        shutdown: &CancellationToken,
    ) -> Result<Session, SourceError> {
        Ok(Session::open(queues, pipeline, shutdown).await?)
    }

    async fn next(&mut self) -> Result<Received, SourceError> {
        let lost = |reason: String| AmqpError::ConsumerLost {
            queue: self.route.queues.queue.clone(),
            reason,
        };
        // Without its copies' channel, every dead letter and retry would go back to the
        // queue and come again at once: the session is opened anew.
        if !self.route.copies.channel.status().connected() {
            return Err(lost("the connection for dead letters and retries was lost".into()).into());
        }
        match self.consumer.next().await {
            Some(Ok(delivery)) => {
                let route = &self.route;
                let (message, receipt) =
                    receive(&route.pipeline, &route.queues, delivery, &self.acks);
                Ok(Received {
                    message,
                    receipt,
                    route: Arc::clone(&self.route),
                })
            }
            Some(Err(error)) => Err(lost(error.to_string()).into()),
            None => Err(lost("the broker cancelled the consumer".into()).into()),
        }
    }

    async fn stop(&mut self) {
        self.cancel().await;
    }

    /// Every delivery the cancelled consumer still buffers, `nack`ed back to the head of the
    /// queue: no publish, so it works during a memory alarm.
    async fn give_back(&mut self) -> usize {
        let mut given = 0;
        while let Ok(Some(Ok(delivery))) =
            tokio::time::timeout(GIVE_BACK_WAIT, self.consumer.next()).await
        {
            let (_, receipt) = receive(
                &self.route.pipeline,
                &self.route.queues,
                delivery,
                &self.acks,
            );
            // As `Delivery::give_back`: where it was, no publish.
            if receipt.nack_requeue().await {
                given += 1;
            }
        }
        given
    }

    async fn close(self) {
        Session::close(self).await;
    }
}

/// How long `give_back` waits for the next buffered delivery of a cancelled consumer: they
/// are in memory, so a wait this long means there are no more.
const GIVE_BACK_WAIT: Duration = Duration::from_millis(200);

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

    async fn retry(&self, attempt: u32, delay: Duration) -> bool {
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = self.route.shutdown.cancelled() => {}
        }
        self.copied(Copying::Retry(attempt)).await
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
enum Copying {
    DeadLetter {
        error_kind: &'static str,
        reason: String,
    },
    Retry(u32),
    Requeue,
}

/// Publishes the copy `copying` of the delivery `receipt` stands for, then acks it.
async fn copy(receipt: &Receipt, route: &Route, copying: &Copying) -> Result<bool, AmqpError> {
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
        Copying::Retry(attempt) => {
            receipt
                .retry(&route.copies, &route.queues.queue, *attempt)
                .await
        }
        Copying::Requeue => receipt.requeue(&route.copies, &route.queues.queue).await,
    }
}

/// How often a parked delivery (see `Received::park`) looks whether the broker lets copies
/// through again.
const BLOCKED_LOOK: Duration = Duration::from_secs(1);

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

/// Queue depths as the broker reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueDepth {
    /// Messages ready for delivery.
    pub ready: u32,
    /// Consumers subscribed.
    pub consumers: u32,
}

/// Connects once, for the operator commands.
pub async fn connect_channel(
    amqp: &AmqpConfig,
    purpose: &str,
) -> Result<(Connection, Channel), AmqpError> {
    let connection = connect(amqp, format!("idem {purpose}")).await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| AmqpError::Connect {
            endpoint: amqp.endpoints(),
            source,
        })?;
    Ok((connection, channel))
}

/// The depth of `queue`, or `None` if it does not exist.
pub async fn queue_depth(amqp: &AmqpConfig, queue: &str) -> Result<Option<QueueDepth>, AmqpError> {
    let (connection, channel) = connect_channel(amqp, "status").await?;
    let declared = topology::inspect(&channel, queue).await;
    let _ = connection.close(200, ShortString::from("done")).await;
    Ok(declared.ok().map(|declared| QueueDepth {
        ready: declared.message_count(),
        consumers: declared.consumer_count(),
    }))
}

/// Messages ready in `source`'s queue and in its dead-letter queue, over one connection.
pub async fn depths(
    kept: &mut Option<Connection>,
    source: &RabbitMqConfig,
) -> Result<source::Depths, AmqpError> {
    let connection = match kept.take() {
        Some(connection) if connection.status().connected() => connection,
        _ => connect(&source.broker, "idem depths".to_string()).await?,
    };
    let read = read_depths(&connection, source).await;
    if read.is_ok() {
        *kept = Some(connection);
    } else {
        let _ = connection.close(200, ShortString::from("done")).await;
    }
    read
}

/// The depths of `source`'s queues, each inspected on a channel of its own (a failed passive
/// declare closes its channel).
async fn read_depths(
    connection: &Connection,
    source: &RabbitMqConfig,
) -> Result<source::Depths, AmqpError> {
    let inspect = async |queue: &str| {
        let channel = connection
            .create_channel()
            .await
            .map_err(|error| AmqpError::Connect {
                endpoint: source.broker.endpoints(),
                source: error,
            })?;
        let declared = topology::inspect(&channel, queue).await;
        if declared.is_ok() {
            let _ = channel.close(200, ShortString::from("done")).await;
        }
        Ok::<_, AmqpError>(declared)
    };
    let waiting = inspect(&source.queue)
        .await?
        .map_err(|error| AmqpError::Topology {
            action: "inspect",
            queue: source.queue.clone(),
            source: error,
        })?;
    let dead_letters = inspect(&source.dead_letter_queue)
        .await?
        .ok()
        .map(|declared| u64::from(declared.message_count()));
    Ok(source::Depths {
        waiting: u64::from(waiting.message_count()),
        unacknowledged: None,
        dead_letters,
        oldest_age: None,
    })
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
fn inbound_message(
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
fn attributes(exchange: &str, routing_key: String) -> Vec<(String, String)> {
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
    fn of(delivery: lapin::message::Delivery, acks: &Acks, attempt: u32) -> Receipt {
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
        headers.insert(
            ShortString::from(headers::REASON),
            AMQPValue::LongString(LongString::from(headers::reason_text(reason))),
        );
        headers.insert(
            ShortString::from(headers::ERROR_KIND),
            AMQPValue::LongString(LongString::from(error_kind)),
        );
        headers.insert(
            ShortString::from(headers::PIPELINE),
            AMQPValue::LongString(LongString::from(pipeline)),
        );
        headers.insert(
            ShortString::from(headers::QUEUE),
            AMQPValue::LongString(LongString::from(queues.queue.as_str())),
        );
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
            Copy::DeadLetter,
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

    /// Publishes a copy back to the pipeline's queue with `attempt` in its headers, waits for
    /// the broker's confirm, then acks the original.
    pub async fn retry(
        &self,
        channel: &CopyChannel,
        queue: &str,
        attempt: u32,
    ) -> Result<bool, AmqpError> {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(
            ShortString::from(headers::ATTEMPT),
            AMQPValue::LongLongInt(i64::from(attempt)),
        );
        self.put_back(channel, queue, headers).await
    }

    /// Publishes a copy to `queue` with `headers`, waits for the broker's confirm, then acks
    /// the original.
    async fn put_back(
        &self,
        channel: &CopyChannel,
        queue: &str,
        headers: FieldTable,
    ) -> Result<bool, AmqpError> {
        self.publish_copy(channel, queue, headers, Copy::Requeue)
            .await?;
        Ok(self.ack().await)
    }

    async fn publish_copy(
        &self,
        channel: &CopyChannel,
        queue: &str,
        headers: FieldTable,
        copy: Copy,
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

/// What a copy is for, which decides the properties it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copy {
    /// Back to the pipeline's queue (a retry, a requeue, a replay).
    Requeue,
    /// To the dead-letter queue, where it must wait for an operator.
    DeadLetter,
}

/// The properties of a copy of a delivery: the original's, persistent, with `headers`; without
/// `user-id` (the broker refuses a publish whose user-id is not the publishing user, and idem
/// is not the producer), and for a dead letter without `expiration` (it must not expire out
/// of the dead-letter queue). The dropped values are kept in `x-idem-…` headers.
fn copy_properties(
    original: &BasicProperties,
    mut headers: FieldTable,
    copy: Copy,
) -> BasicProperties {
    let keep_expiration = copy == Copy::Requeue;
    let mut properties = BasicProperties::default().with_delivery_mode(PERSISTENT);
    macro_rules! keep {
        ($getter:ident, $setter:ident) => {
            if let Some(value) = original.$getter() {
                properties = properties.$setter(value.clone());
            }
        };
    }
    keep!(content_type, with_content_type);
    keep!(content_encoding, with_content_encoding);
    keep!(priority, with_priority);
    keep!(correlation_id, with_correlation_id);
    keep!(reply_to, with_reply_to);
    keep!(message_id, with_message_id);
    keep!(timestamp, with_timestamp);
    keep!(kind, with_type);
    keep!(app_id, with_app_id);
    keep!(cluster_id, with_cluster_id);
    if let Some(expiration) = original.expiration() {
        if keep_expiration {
            properties = properties.with_expiration(expiration.clone());
        } else {
            headers.insert(
                ShortString::from(headers::EXPIRATION),
                AMQPValue::LongString(LongString::from(expiration.as_str())),
            );
        }
    }
    if let Some(user_id) = original.user_id() {
        headers.insert(
            ShortString::from(headers::USER_ID),
            AMQPValue::LongString(LongString::from(user_id.as_str())),
        );
    }
    properties.with_headers(headers)
}

/// The turn to publish a copy: waited for at most `CONFIRM_WAIT`, and not at all while the
/// broker blocks the publishing connection (the copy would wait for the alarm's end); the
/// reason when there is none.
async fn one_copy_at_a_time(
    channel: &CopyChannel,
) -> Result<tokio::sync::MutexGuard<'static, ()>, String> {
    let blocked = || "RabbitMQ blocks publishing (a memory or disk alarm)".to_string();
    if channel.blocked() {
        return Err(blocked());
    }
    let turn = COPY_PUBLISH.lock();
    tokio::pin!(turn);
    let deadline = tokio::time::sleep(publish::CONFIRM_WAIT);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            guard = &mut turn => {
                return if channel.blocked() { Err(blocked()) } else { Ok(guard) };
            }
            () = &mut deadline => {
                return Err(format!(
                    "another copy waited {:?} for the broker's confirm",
                    publish::CONFIRM_WAIT
                ));
            }
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                if channel.blocked() {
                    return Err(blocked());
                }
            }
        }
    }
}

/// Serialises copies (dead letters, retries, replays), so each confirm is matched with its
/// own returned message. Copies are rare next to acks; the wait costs nothing measurable.
static COPY_PUBLISH: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn header_integer(properties: &BasicProperties, name: &str) -> Option<i64> {
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

fn header_text(value: &AMQPValue) -> String {
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
