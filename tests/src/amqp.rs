//! RabbitMQ as a test uses it: connections and channels, queues declared as infrastructure
//! code would, publishing, and what the broker reports (`rabbitmqctl`).

use std::process::Command;

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The arguments of a quorum queue, with `delivery_limit` when given.
pub fn quorum_arguments(delivery_limit: Option<i64>) -> FieldTable {
    use lapin::types::{AMQPValue, LongString};
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    if let Some(limit) = delivery_limit {
        arguments.insert(
            ShortString::from("x-delivery-limit"),
            AMQPValue::LongLongInt(limit),
        );
    }
    arguments
}

/// Deletes `queue` and declares it again, durable, with `arguments` (as infrastructure code
/// would, e.g. a quorum queue with a delivery limit).
pub async fn redeclare(channel: &Channel, queue: &str, arguments: FieldTable) {
    channel
        .queue_delete(ShortString::from(queue), QueueDeleteOptions::default())
        .await
        .expect("delete queue");
    declare(channel, queue, arguments).await;
}

/// Declares `queue` durable, classic and without arguments, as a host with the default
/// settings does.
pub async fn declare_durable(channel: &Channel, queue: &str) {
    declare(channel, queue, FieldTable::default()).await;
}

pub(super) async fn declare(channel: &Channel, queue: &str, arguments: FieldTable) {
    channel
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await
        .expect("declare test queue");
}

/// A new broker connection with a channel in confirm mode; keep the connection while using the channel.
pub async fn connect_channel() -> (Connection, Channel) {
    connect_channel_to(&amqp_url()).await
}

/// Like [`connect_channel`], to the broker at `url`.
pub async fn connect_channel_to(url: &str) -> (Connection, Channel) {
    try_connect_channel_to(url)
        .await
        .expect("RabbitMQ reachable (scripts/services.sh starts it)")
}

/// Like [`connect_channel_to`], with the broker's refusal or absence as an error (a broker
/// restarting under a fault).
pub async fn try_connect_channel_to(url: &str) -> Result<(Connection, Channel), lapin::Error> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok((connection, channel))
}

pub async fn publish(channel: &Channel, queue: &str, body: &[u8]) {
    publish_with_headers(channel, queue, body, &[]).await;
}

/// [`publish`] with text `headers`, as a producer sets them.
pub async fn publish_with_headers(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) {
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"));
    if !headers.is_empty() {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                ShortString::from(*name),
                lapin::types::AMQPValue::LongString((*value).into()),
            );
        }
        properties = properties.with_headers(table);
    }
    let confirm = channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(queue),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .expect("publish")
        .await
        .expect("publish confirm");
    assert!(confirm.is_ack(), "broker refused a test message");
}

pub async fn queue_ready(channel: &Channel, queue: &str) -> u32 {
    inspect(channel, queue)
        .await
        .expect("queue exists")
        .message_count()
}

/// `queue` as a passive declare finds it.
async fn inspect(channel: &Channel, queue: &str) -> Result<lapin::Queue, lapin::Error> {
    channel
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
}

/// The messages `queue` holds, if it exists (asked on a connection of its own: a passive
/// declare of a missing queue closes its channel).
pub async fn queue_waiting(queue: &str) -> Option<u32> {
    let (_connection, channel) = connect_channel().await;
    let found = inspect(&channel, queue).await;
    found.ok().map(|queue| queue.message_count())
}

/// Deliveries of `queue` that a consumer holds unacked, from `rabbitmqctl` (AMQP cannot tell).
pub fn unacked(queue: &str) -> u64 {
    queue_figure(queue, "messages_unacknowledged")
}

/// Consumers subscribed to `queue`, as the broker sees them.
pub fn consumers(queue: &str) -> u64 {
    queue_figure(queue, "consumers")
}

/// One `rabbitmqctl list_queues` column of `queue`; 0 if the queue does not exist.
pub(super) fn queue_figure(queue: &str, column: &str) -> u64 {
    let output = Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "--quiet",
            "--no-table-headers",
            "name",
            column,
        ])
        .output()
        .expect("rabbitmqctl runs (it ships with rabbitmq-server)");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .find(|(name, _)| *name == queue)
        .and_then(|(_, count)| count.trim().parse().ok())
        .unwrap_or(0)
}

/// Closes the broker connections whose client-provided name contains `fragment` (idem names
/// its connections `idem <pipeline> on <queue> (pid <pid>)`). Returns how many it closed.
pub fn close_connections_named(fragment: &str) -> u64 {
    let output = Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "--quiet",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl runs");
    let mut closed = 0;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some((pid, properties)) = line.split_once('\t') else {
            continue;
        };
        if !properties.contains(&format!("\"idem loyalty on {fragment} ")) {
            continue;
        }
        let status = Command::new("rabbitmqctl")
            .args(["close_connection", pid.trim(), "idem fault test"])
            .status();
        if matches!(status, Ok(status) if status.success()) {
            closed += 1;
        }
    }
    closed
}

pub(super) fn amqp_text(value: &lapin::types::AMQPValue) -> String {
    use lapin::types::AMQPValue;
    match value {
        AMQPValue::LongString(text) => String::from_utf8_lossy(text.as_bytes()).into_owned(),
        AMQPValue::LongLongInt(integer) => integer.to_string(),
        other => format!("{other:?}"),
    }
}
