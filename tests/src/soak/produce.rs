//! The soak's producer: orders, their duplicates, malformed bodies and hostile headers, to
//! every source, each publish retried until the broker confirms it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use crate::order;

use super::kafka::SoakTopic;

pub(super) fn customer(order_id: i64) -> i64 {
    order_id % 41
}

pub(super) fn total(order_id: i64) -> i64 {
    100 + (order_id * 61) % 30_000
}

/// The body of the `n`th malformed message (never valid JSON).
pub(super) fn bad_body(n: i64) -> Vec<u8> {
    format!("soak-malformed-{n} {{").into_bytes()
}

/// What the producer published: every order reached each source at least once (confirmed),
/// and these malformed bodies.
pub(super) struct Produced {
    /// Distinct orders, `1..=orders`, to each source.
    pub(super) orders: i64,
    pub(super) bad: BTreeSet<Vec<u8>>,
    pub(super) deliveries: u64,
}

/// Where the producer publishes each order: the loyalty and receipts queues, the stream's
/// subject, the Kafka topic.
pub(super) struct Targets {
    pub(super) queue: String,
    pub(super) receipts_queue: String,
    pub(super) stream: async_nats::jetstream::Context,
    pub(super) subject: String,
    pub(super) kafka: Arc<SoakTopic>,
}

/// Publishes `orders` orders to every target, spread over `duration`, with duplicates (every
/// 7th order again) and a malformed message after every `bad_every`th order. Each publish is
/// retried until the broker confirms it, through broker restarts.
pub(super) async fn produce(
    targets: Targets,
    orders: i64,
    bad_every: i64,
    duration: Duration,
) -> Produced {
    let Targets {
        queue,
        receipts_queue,
        stream,
        subject,
        kafka,
    } = targets;
    let mut rabbit = RabbitPublisher::to(&crate::amqp_url());
    let mut produced = Produced {
        orders,
        bad: BTreeSet::new(),
        deliveries: 0,
    };
    let pace = duration.div_f64(orders as f64 * 1.1);
    let mut bodies = Vec::new();
    for order_id in 1..=orders {
        let started = Instant::now();
        bodies.clear();
        bodies.push(order(order_id, customer(order_id), total(order_id)));
        if order_id % 7 == 0 {
            bodies.push(order(order_id, customer(order_id), total(order_id)));
        }
        if order_id % bad_every == 0 {
            let bad = bad_body(order_id / bad_every);
            produced.bad.insert(bad.clone());
            bodies.push(bad);
        }
        // Every 11th order carries a hostile producer's headers: data, never a fault.
        let hostile = order_id % 11 == 0;
        let hostile_pairs = if hostile {
            hostile_headers()
        } else {
            Vec::new()
        };
        let kafka_headers: Vec<(&str, &str)> = hostile_pairs
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect();
        for body in &bodies {
            rabbit.publish(&queue, body).await;
            rabbit
                .publish_with(
                    &receipts_queue,
                    body,
                    hostile.then(|| field_table(&hostile_pairs)),
                )
                .await;
            while !stored_on_stream(&stream, &subject, body, hostile).await {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            kafka
                .produce(customer(order_id), body, &kafka_headers)
                .await;
            produced.deliveries += 4;
        }
        if let Some(rest) = pace.checked_sub(started.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
    produced
}

/// Headers a hostile producer sets: a `tracestate` with a NUL beside a valid
/// `traceparent`, an attempt and a rejection time past any number, a control character and
/// 10 KB in another header.
fn hostile_headers() -> Vec<(&'static str, String)> {
    vec![
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
        ),
        ("tracestate", "k=v\0".to_string()),
        ("x-idem-attempt", "99999999999999999999999".to_string()),
        ("x-idem-rejected-at", "18446744073709551615".to_string()),
        ("x-note", format!("\u{1}{}", "x".repeat(10 * 1024))),
    ]
}

/// `headers` as an AMQP field table.
fn field_table(headers: &[(&str, String)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in headers {
        table.insert(
            ShortString::from(*name),
            AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
        );
    }
    table
}

/// Publishes `body` to `subject` (with a hostile producer's headers when `hostile`); whether
/// the stream confirmed it stored it.
async fn stored_on_stream(
    context: &async_nats::jetstream::Context,
    subject: &str,
    body: &[u8],
    hostile: bool,
) -> bool {
    let mut headers = async_nats::HeaderMap::new();
    if hostile {
        headers.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        headers.insert(
            "tracestate",
            format!("k={}\u{1}", "v".repeat(10 * 1024)).as_str(),
        );
        headers.insert("x-idem-attempt", "-1");
    }
    let stored = async {
        context
            .publish_with_headers(
                subject.to_string(),
                headers,
                bytes::Bytes::copy_from_slice(body),
            )
            .await?
            .await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(10), stored).await,
        Ok(Ok(_))
    )
}

/// A publisher to RabbitMQ that reconnects after a broker restart (or a node's death).
pub struct RabbitPublisher {
    url: String,
    connection: Option<(Connection, Channel)>,
}

impl RabbitPublisher {
    /// A publisher to the broker at `url`, connecting at its first publish.
    pub fn to(url: &str) -> RabbitPublisher {
        RabbitPublisher {
            url: url.to_string(),
            connection: None,
        }
    }

    /// Publishes `body` to `queue` persistently and waits for the confirm, retrying (on a
    /// new connection) until the broker confirms it.
    pub async fn publish(&mut self, queue: &str, body: &[u8]) {
        self.publish_with(queue, body, None).await;
    }

    /// [`RabbitPublisher::publish`] with `headers`.
    pub async fn publish_with(&mut self, queue: &str, body: &[u8], headers: Option<FieldTable>) {
        loop {
            if self
                .connection
                .as_ref()
                .is_none_or(|(_, channel)| !channel.status().connected())
            {
                self.connection = match tokio::time::timeout(
                    Duration::from_secs(5),
                    crate::try_connect_channel_to(&self.url),
                )
                .await
                {
                    Ok(Ok(connected)) => Some(connected),
                    _ => {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                };
            }
            let Some((_, channel)) = &self.connection else {
                continue;
            };
            let confirmed = async {
                channel
                    .basic_publish(
                        ShortString::from(""),
                        ShortString::from(queue),
                        BasicPublishOptions::default(),
                        body,
                        match &headers {
                            Some(headers) => BasicProperties::default()
                                .with_delivery_mode(2)
                                .with_headers(headers.clone()),
                            None => BasicProperties::default().with_delivery_mode(2),
                        },
                    )
                    .await?
                    .await
            };
            match tokio::time::timeout(Duration::from_secs(10), confirmed).await {
                Ok(Ok(confirmation)) if confirmation.is_ack() => return,
                _ => {
                    self.connection = None;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}
