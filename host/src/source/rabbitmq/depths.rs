//! What waits in a pipeline's queues: ready and unacknowledged messages and the dead letters,
//! read with a passive declare, for `idem status`, the console and the sampled gauges.

use lapin::types::ShortString;
use lapin::{Channel, Connection};

use crate::config::{AmqpConfig, RabbitMqConfig};
use crate::source;

use super::AmqpError;
use super::connect::connect;
use super::topology::{self};

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
pub(super) async fn read_depths(
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
        ..source::Depths::default()
    })
}
