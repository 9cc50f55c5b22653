//! Publishes sample `OrderCompleted` traffic with duplicates, for the demo and benchmarks.
//!
//! `idem-traffic --queue order-completed --orders 1000 --duplicates 0.2` publishes 1,000
//! distinct orders plus 200 redeliveries of random ones, in shuffled order, persistently and
//! with publisher confirms. With `--subject orders.completed` it publishes to NATS JetStream
//! instead (`--nats-url`, default `nats://127.0.0.1:4222`), each message stored by the stream
//! that captures the subject before the next is sent.

use anyhow::Context;
use clap::Parser;
use lapin::options::QueueDeclareOptions;
use lapin::types::{FieldTable, ShortString};
use rand::seq::SliceRandom;

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
        let body = idem_e2e::order(
            *order_id,
            order_id % args.customers + 1,
            order_total(*order_id),
        );
        target.publish(&body).await?;
    }
    let mut poison = 0;
    if args.poison {
        for body in [
            &b"{\"order_id\": 1, \"customer_id\": "[..],
            &br#"{"order_id": 2, "total_cents": 500}"#[..],
            &br#"{"order_id": 3, "customer_id": 1, "total_cents": -500}"#[..],
        ] {
            target.publish(body).await?;
            poison += 1;
        }
    }
    println!(
        "published {} messages to {:?}: {} distinct orders, {} duplicate deliveries, {} malformed",
        order_ids.len() + poison,
        args.subject.as_ref().unwrap_or(&args.queue),
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

/// Where the traffic goes: a RabbitMQ queue (declared durable if missing), or a JetStream
/// subject (a stream must capture it; `idem run` creates one with `declare`).
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
}

impl Target {
    async fn open(args: &Args) -> anyhow::Result<Target> {
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

    async fn publish(&self, body: &[u8]) -> anyhow::Result<()> {
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
        }
        Ok(())
    }
}
