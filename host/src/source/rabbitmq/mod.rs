//! RabbitMQ through lapin: connect, declare, consume, dead-letter, acknowledge.
//!
//! Architecture invariant: publishes to the dead-letter or retry queue are confirmed by the
//! broker before the original delivery is acked, so a rejected message is never lost.
//!
//! Here: the error and the `Session` a pipeline consumes through. `connect` reaches the
//! broker, `topology` declares or checks the queues, `received` settles a delivery (`acks`
//! owns a channel's acks, `publish` sends copies and confirms them), `depths` reads what
//! waits, `check` and `dead_letters` serve `idem check` and `idem dlq`.

mod acks;
pub mod check;
mod connect;
pub mod dead_letters;
mod delay;
mod depths;
pub mod publish;
mod received;
pub mod topology;

pub use acks::Acks;
pub use connect::connect;
pub use depths::{QueueDepth, connect_channel, depths, queue_depth};
pub use received::{Receipt, Received, published_attributes, receive};

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, Consumer};
use tokio_util::sync::CancellationToken;

use crate::config::{PipelineConfig, RabbitMqConfig, SourceConfig};
use crate::source::standing::Lent;
use crate::source::{Source, SourceError};

use publish::CopyChannel;
use topology::Role;

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
            Ok(consuming) => Self::copies(&name, queues, pipeline)
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

    /// The publishing connection and its channel in confirm mode, for the copies (with the
    /// first retry wait's delay queue declared on it, see `delay::declare_first`).
    async fn copies(
        name: &str,
        queues: &RabbitMqConfig,
        pipeline: &PipelineConfig,
    ) -> Result<(Connection, Channel), AmqpError> {
        let publisher = connect(&queues.broker, format!("{name} (copies)")).await?;
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
        if let Err(error) = delay::declare_first(&channel, queues, pipeline).await {
            let _ = publisher
                .close(200, ShortString::from("idem stopping"))
                .await;
            return Err(error);
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
        _lent: &Lent,
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
