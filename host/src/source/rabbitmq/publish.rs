//! The one way idem publishes to RabbitMQ: persistent, `mandatory`, on a channel in confirm
//! mode, and done only when the broker confirmed it. Copies of deliveries (retries, dead
//! letters, replays) and the outbox relay's messages all go through [`confirmed`]; copies
//! keep the properties their purpose allows (`copy_properties`) and go one at a time.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};

use crate::source::headers;

use super::PERSISTENT;

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

/// What a copy is for, which decides the properties it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CopyFor {
    /// Back to the pipeline's queue (a retry, a requeue, a replay).
    Requeue,
    /// To the dead-letter queue, where it must wait for an operator.
    DeadLetter,
    /// To a delay queue, whose own time it waits (a producer's `expiration` would cut it).
    Delay,
}

/// The properties of a copy of a delivery: the original's, persistent, with `headers`; without
/// `user-id` (the broker refuses a publish whose user-id is not the publishing user, and idem
/// is not the producer), and for a dead letter or a delayed retry without `expiration` (it
/// must not expire out of the dead-letter queue, nor cut the delay queue's wait). The dropped values are kept in `x-idem-…` headers.
pub(super) fn copy_properties(
    original: &BasicProperties,
    mut headers: FieldTable,
    copy: CopyFor,
) -> BasicProperties {
    let keep_expiration = copy == CopyFor::Requeue;
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
pub(super) async fn one_copy_at_a_time(
    channel: &CopyChannel,
) -> Result<tokio::sync::MutexGuard<'static, ()>, String> {
    let blocked = || "RabbitMQ blocks publishing (a memory or disk alarm)".to_string();
    if channel.blocked() {
        return Err(blocked());
    }
    let turn = COPY_PUBLISH.lock();
    tokio::pin!(turn);
    let deadline = tokio::time::sleep(CONFIRM_WAIT);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            guard = &mut turn => {
                return if channel.blocked() { Err(blocked()) } else { Ok(guard) };
            }
            () = &mut deadline => {
                return Err(format!(
                    "another copy waited {:?} for the broker's confirm",
                    CONFIRM_WAIT
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
pub(super) static COPY_PUBLISH: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
