//! Publishes sample `OrderCompleted` traffic with duplicates, for the demo and benchmarks.
//!
//! `idem-traffic --queue order-completed --orders 1000 --duplicates 0.2` publishes 1,000
//! distinct orders plus 200 redeliveries of random ones, in shuffled order, persistently and
//! with publisher confirms. With `--subject orders.completed` it publishes to NATS JetStream
//! instead (`--nats-url`, default `nats://127.0.0.1:4222`), each message stored by the stream
//! that captures the subject before the next is sent. With `--topic orders --kafka
//! 127.0.0.1:9092` it produces to a Kafka topic (created if missing), each record keyed by its
//! customer, by an idempotent producer (`acks=all`) with up to 10,000 records awaiting their
//! delivery reports.

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::QueueDeclareOptions;
use lapin::types::{FieldTable, ShortString};
use rand::seq::SliceRandom;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};

#[derive(Parser)]
struct Args {
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    #[arg(long, default_value = "order-completed")]
    queue: String,
    /// Publish to this NATS JetStream subject instead of a RabbitMQ queue.
    #[arg(long)]
    subject: Option<String>,
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Produce to this Kafka topic instead of a RabbitMQ queue.
    #[arg(long, requires = "kafka")]
    topic: Option<String>,
    /// The Kafka brokers (`host:port`, comma-separated) `--topic` is on.
    #[arg(long)]
    kafka: Option<String>,
    /// Partitions of the Kafka topic, when it is created.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Distinct orders to publish.
    #[arg(long, default_value_t = 1000)]
    orders: i64,
    /// Extra deliveries of already-published orders, as a fraction of `orders`.
    #[arg(long, default_value_t = 0.2)]
    duplicates: f64,
    /// Customers the orders are spread over.
    #[arg(long, default_value_t = 20)]
    customers: i64,
    /// Also publish a few malformed messages, which must end in the dead-letter queue.
    #[arg(long)]
    poison: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let target = Target::open(&args).await?;
    let mut rng = rand::rng();
    let duplicate_count = (args.orders as f64 * args.duplicates).round() as i64;
    let mut order_ids: Vec<i64> = (1..=args.orders).collect();
    for _ in 0..duplicate_count {
        order_ids.push(rand::Rng::random_range(&mut rng, 1..=args.orders));
    }
    order_ids.shuffle(&mut rng);
    for order_id in &order_ids {
        let customer = order_id % args.customers + 1;
        let body = idem_e2e::order(*order_id, customer, order_total(*order_id));
        target
            .publish(&format!("customer-{customer}"), &body)
            .await?;
    }
    let mut poison = 0;
    if args.poison {
        for body in [
            &b"{\"order_id\": 1, \"customer_id\": "[..],
            &br#"{"order_id": 2, "total_cents": 500}"#[..],
            &br#"{"order_id": 3, "customer_id": 1, "total_cents": -500}"#[..],
        ] {
            target.publish("poison", body).await?;
            poison += 1;
        }
    }
    target.flush().await?;
    println!(
        "published {} messages to {:?}: {} distinct orders, {} duplicate deliveries, {} malformed",
        order_ids.len() + poison,
        args.subject
            .as_ref()
            .or(args.topic.as_ref())
            .unwrap_or(&args.queue),
        args.orders,
        duplicate_count,
        poison
    );
    Ok(())
}

/// Deterministic order totals, so every run of the demo credits the same points.
fn order_total(order_id: i64) -> i64 {
    500 + (order_id * 7919) % 20_000
}

/// Where the traffic goes: a RabbitMQ queue (declared durable if missing), a JetStream
/// subject (a stream must capture it; `idem run` creates one with `declare`), or a Kafka
/// topic.
enum Target {
    Queue {
        _connection: lapin::Connection,
        channel: lapin::Channel,
        queue: String,
    },
    Stream {
        context: async_nats::jetstream::Context,
        subject: String,
    },
    Topic {
        producer: FutureProducer,
        topic: String,
        /// Delivery reports not received yet.
        in_flight: std::sync::Mutex<FuturesUnordered<DeliveryFuture>>,
    },
}

/// Records awaiting their delivery reports before the next produce waits for one.
const KAFKA_IN_FLIGHT: usize = 10_000;

impl Target {
    async fn open(args: &Args) -> anyhow::Result<Target> {
        if let (Some(topic), Some(brokers)) = (&args.topic, &args.kafka) {
            return Target::topic(brokers, topic, args.partitions).await;
        }
        if let Some(subject) = &args.subject {
            let client = async_nats::connect(args.nats_url.as_str())
                .await
                .with_context(|| format!("connect to NATS at {}", args.nats_url))?;
            return Ok(Target::Stream {
                context: async_nats::jetstream::new(client),
                subject: subject.clone(),
            });
        }
        let (connection, channel) = idem_e2e::connect_channel_to(&args.amqp_url).await;
        channel
            .queue_declare(
                ShortString::from(args.queue.as_str()),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("declare queue {:?}", args.queue))?;
        Ok(Target::Queue {
            _connection: connection,
            channel,
            queue: args.queue.clone(),
        })
    }

    /// A Kafka topic on `brokers`, created with `partitions` if it is missing.
    async fn topic(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<Target> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        let admin: AdminClient<DefaultClientContext> =
            config.create().context("a Kafka admin client")?;
        let created = admin
            .create_topics(
                [&NewTopic::new(
                    topic,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new(),
            )
            .await
            .with_context(|| format!("create topic {topic:?} on {brokers}"))?;
        for result in created {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => anyhow::bail!("create topic {name:?}: {code}"),
            }
        }
        let producer: FutureProducer = config
            .clone()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .create()
            .context("a Kafka producer")?;
        Ok(Target::Topic {
            producer,
            topic: topic.to_string(),
            in_flight: std::sync::Mutex::new(FuturesUnordered::new()),
        })
    }

    async fn publish(&self, key: &str, body: &[u8]) -> anyhow::Result<()> {
        match self {
            Target::Queue { channel, queue, .. } => {
                idem_e2e::publish(channel, queue, body).await;
            }
            Target::Stream { context, subject } => {
                context
                    .publish(subject.clone(), bytes::Bytes::copy_from_slice(body))
                    .await
                    .with_context(|| format!("publish to {subject:?}"))?
                    .await
                    .with_context(|| {
                        format!("no stream stored the message on {subject:?}: start idem first (it creates the stream)")
                    })?;
            }
            Target::Topic {
                producer,
                topic,
                in_flight,
            } => {
                let record = FutureRecord::to(topic).key(key).payload(body);
                let delivery = producer
                    .send_result(record)
                    .map_err(|(error, _)| anyhow::anyhow!("produce to {topic:?}: {error}"))?;
                let full = {
                    let in_flight = in_flight.lock().expect("in flight");
                    in_flight.push(delivery);
                    in_flight.len() >= KAFKA_IN_FLIGHT
                };
                if full {
                    self.flush().await?;
                }
            }
        }
        Ok(())
    }

    /// Waits for every record's delivery report (Kafka; the others confirm each message as it
    /// goes).
    async fn flush(&self) -> anyhow::Result<()> {
        let Target::Topic {
            topic, in_flight, ..
        } = self
        else {
            return Ok(());
        };
        let mut waiting = std::mem::take(&mut *in_flight.lock().expect("in flight"));
        while let Some(report) = waiting.next().await {
            match report {
                Ok(Ok(_)) => {}
                Ok(Err((error, _))) => anyhow::bail!("produce to {topic:?}: {error}"),
                Err(_) => anyhow::bail!("produce to {topic:?}: the producer went away"),
            }
        }
        Ok(())
    }
}
