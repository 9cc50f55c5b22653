//! The one way idem publishes to RabbitMQ: persistent, `mandatory`, on a channel in confirm
//! mode, and done only when the broker confirmed it. Copies of deliveries (retries, dead
//! letters, replays) and the outbox relay's messages all go through [`confirmed`].

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation};

/// Why a publish was not confirmed.
#[derive(Debug, thiserror::Error)]
pub enum Unconfirmed {
    /// The channel or the connection failed before the broker answered.
    #[error("{0}")]
    Channel(#[from] lapin::Error),
    /// The broker routed the message to no queue and returned it.
    #[error("routed to no queue (the message came back)")]
    Returned,
    /// The broker refused to store it (`basic.nack`).
    #[error("the broker refused the message")]
    Refused,
    /// The channel is not in confirm mode: nothing says the message was stored.
    #[error("publisher confirms are off")]
    NotConfirmed,
    /// No confirm came within [`CONFIRM_WAIT`]: the broker may be blocking publishers (a
    /// memory or disk alarm), or the confirm was lost. Not stored, as far as idem knows.
    #[error(
        "no confirm within {0:?} (a memory or disk alarm blocks publishers, or the broker is overloaded)"
    )]
    TimedOut(Duration),
}

/// A channel copies of deliveries are published on, and whether the broker blocks its
/// connection (a memory or disk alarm stops the broker reading from connections that
/// publish).
#[derive(Clone)]
pub struct CopyChannel {
    pub channel: Channel,
    publisher: Option<lapin::ConnectionStatus>,
}

impl CopyChannel {
    /// `channel` on the connection whose state `publisher` is.
    pub fn watched(channel: Channel, publisher: lapin::ConnectionStatus) -> CopyChannel {
        CopyChannel {
            channel,
            publisher: Some(publisher),
        }
    }

    /// `channel`, its connection's blocks not watched (an operator's command).
    pub fn unwatched(channel: Channel) -> CopyChannel {
        CopyChannel {
            channel,
            publisher: None,
        }
    }

    /// Whether the broker has said it blocks the connection.
    pub fn blocked(&self) -> bool {
        self.publisher
            .as_ref()
            .is_some_and(lapin::ConnectionStatus::blocked)
    }
}

/// The longest wait for a broker's confirm. Past it the publish counts as failed (the
/// caller keeps the message: a copy's original goes back to its queue, an outbox row is
/// tried again), so a blocked broker holds a worker or a relay pass this long, not forever.
pub const CONFIRM_WAIT: Duration = Duration::from_secs(15);

/// Publishes `body` with `properties` to `exchange` (`""`, the default exchange, routes by
/// queue name) under `routing_key`, `mandatory`, and waits for the broker's confirm.
///
/// Only one mandatory publish may wait on a channel at a time: a returned message belongs to
/// the one publish awaiting its confirm. Waits at most [`CONFIRM_WAIT`], and says so when it
/// gives up.
pub async fn confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), Unconfirmed> {
    let publish = publish_and_confirm(channel, exchange, routing_key, body, properties);
    match tokio::time::timeout(CONFIRM_WAIT, publish).await {
        Ok(confirmed) => confirmed,
        Err(_) => {
            tracing::warn!(
                exchange,
                routing_key,
                waited_s = CONFIRM_WAIT.as_secs(),
                "RabbitMQ confirmed no publish in time (a memory or disk alarm blocks publishers?); the message is kept and tried again."
            );
            Err(Unconfirmed::TimedOut(CONFIRM_WAIT))
        }
    }
}

async fn publish_and_confirm(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), Unconfirmed> {
    let confirm = channel
        .basic_publish(
            ShortString::from(exchange),
            ShortString::from(routing_key),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await?
        .await?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_returned)) => Err(Unconfirmed::Returned),
        Confirmation::Nack(_) => Err(Unconfirmed::Refused),
        Confirmation::NotRequested => Err(Unconfirmed::NotConfirmed),
    }
}
