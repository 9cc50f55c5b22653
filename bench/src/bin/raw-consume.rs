//! The broker's raw rate: a consumer that does nothing but ack, on the same queue, messages
//! and prefetch as an idem run, so `bench/throughput.sh` can say how much of the broker's own
//! ceiling idem reaches.
//!
//! `raw-consume --queue Q --expect N --prefetch P --channels C` consumes until N messages are
//! acked (one ack per delivery, as a plain consumer does) over C channels of one connection,
//! then prints `consumed N messages in S seconds: R messages/s`. The clock starts at the
//! first delivery.
//!
//! `raw-consume --stream S …` does the same on NATS JetStream stream S (`NATS_URL`, default
//! `nats://127.0.0.1:4222`): a durable pull consumer `raw-consume` (explicit acks), pulled by C
//! tasks with batches of P, each message acked once (a plain ack, not confirmed by the server:
//! what a plain consumer sends).
//!
//! `raw-consume --kafka BROKERS --topic T …` does the same on Kafka topic T: C consumers of the
//! group `raw-consume` (one thread each), each message's offset stored as it arrives (Kafka's
//! counterpart of one plain ack per delivery) and committed by librdkafka every second, the
//! last ones waited for (at most ten seconds) at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Connection, ConnectionProperties};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};

fn argument(name: &str) -> Option<String> {
    let mut arguments = std::env::args().skip(1);
    while let Some(argument) = arguments.next() {
        if argument == name {
            return arguments.next();
        }
    }
    None
}

fn required<T: std::str::FromStr>(name: &str) -> T {
    argument(name)
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| {
            eprintln!(
                "raw-consume: {name} is required (usage: raw-consume --queue Q | --stream S | --kafka BROKERS --topic T --expect N --prefetch P --channels C)"
            );
            std::process::exit(2)
        })
}

#[tokio::main]
async fn main() {
    let expect: u64 = required("--expect");
    let prefetch: u16 = required("--prefetch");
    let channels: u16 = required("--channels");
    let (counted, mut count) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let done = Arc::new(AtomicBool::new(false));
    let (finished, topic_consumers) = std::sync::mpsc::channel::<()>();
    let mut consumers = 0;
    let connection = match (argument("--stream"), argument("--kafka")) {
        (Some(stream), _) => {
            consume_stream(&stream, prefetch, channels, counted).await;
            None
        }
        (None, Some(brokers)) => {
            let topic: String = required("--topic");
            consume_topic(&brokers, &topic, channels, counted, &done, &finished);
            consumers = channels;
            None
        }
        (None, None) => {
            Some(consume_queue(&required::<String>("--queue"), prefetch, channels, counted).await)
        }
    };
    let mut first = None;
    let mut last = None;
    let mut acked = 0u64;
    while acked < expect {
        match tokio::time::timeout(Duration::from_secs(30), count.recv()).await {
            Ok(Some(at)) => {
                first.get_or_insert(at);
                last = Some(at);
                acked += 1;
            }
            Ok(None) | Err(_) => {
                eprintln!("raw-consume: only {acked} of {expect} messages arrived");
                std::process::exit(1)
            }
        }
    }
    let seconds = match (first, last) {
        (Some(first), Some(last)) => last.duration_since(first).as_secs_f64().max(1e-9),
        _ => 1e-9,
    };
    // Kafka: each consumer commits its last offsets; a consumer that does not finish within
    // ten seconds is left behind (and what it did not commit shows in the depth check).
    done.store(true, Ordering::Relaxed);
    for _ in 0..consumers {
        if topic_consumers
            .recv_timeout(Duration::from_secs(10))
            .is_err()
        {
            eprintln!("raw-consume: a Kafka consumer did not finish its last commit within 10 s");
            break;
        }
    }
    println!(
        "consumed {acked} messages in {seconds:.3} seconds: {:.1} messages/s",
        acked as f64 / seconds
    );
    if let Some(connection) = connection {
        let _ = connection.close(200, ShortString::from("done")).await;
    }
}

/// Consumes `queue` over `channels` channels, sending the time of each ack to `counted`.
async fn consume_queue(
    queue: &str,
    prefetch: u16,
    channels: u16,
    counted: tokio::sync::mpsc::UnboundedSender<Instant>,
) -> Connection {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string());
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|error| {
            eprintln!("raw-consume: cannot connect to {url}: {error}");
            std::process::exit(1)
        });
    for number in 0..channels {
        let channel = connection.create_channel().await.expect("channel");
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .expect("qos");
        let mut consumer = channel
            .basic_consume(
                ShortString::from(queue),
                ShortString::from(format!("raw-consume-{number}")),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|error| {
                eprintln!("raw-consume: cannot consume from {queue}: {error}");
                std::process::exit(1)
            });
        let counted = counted.clone();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                if delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .is_err()
                {
                    break;
                }
                if counted.send(Instant::now()).is_err() {
                    break;
                }
            }
        });
    }
    connection
}

/// Consumes Kafka topic `topic` with `channels` consumers of the group `raw-consume`, each
/// polling on a thread of its own and committing each message's offset (asynchronously),
/// sending the time of each commit to `counted`; each commits its position synchronously
/// once `done`.
fn consume_topic(
    brokers: &str,
    topic: &str,
    channels: u16,
    counted: tokio::sync::mpsc::UnboundedSender<Instant>,
    done: &Arc<AtomicBool>,
    finished: &std::sync::mpsc::Sender<()>,
) {
    for _ in 0..channels {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", "raw-consume")
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set("auto.commit.interval.ms", "1000")
            // tansu holds a new group's first assignment half a session timeout.
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .create()
            .unwrap_or_else(|error| {
                eprintln!("raw-consume: cannot create a Kafka consumer: {error}");
                std::process::exit(1)
            });
        consumer.subscribe(&[topic]).unwrap_or_else(|error| {
            eprintln!("raw-consume: cannot subscribe to {topic}: {error}");
            std::process::exit(1)
        });
        let counted = counted.clone();
        let done = Arc::clone(done);
        let finished = finished.clone();
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                match consumer.poll(Duration::from_millis(100)) {
                    Some(Ok(message)) => {
                        if consumer.store_offset_from_message(&message).is_err() {
                            break;
                        }
                        let _ = counted.send(Instant::now());
                    }
                    Some(Err(error)) => eprintln!("raw-consume: {error}"),
                    None => {}
                }
            }
            // The last commit, waited for by polling until the group has it (a synchronous
            // commit can wait for ever on a group that is rebalancing).
            let _ = consumer.commit_consumer_state(CommitMode::Async);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                let _ = consumer.poll(Duration::from_millis(100));
                let position = consumer.position().ok();
                let committed = consumer.committed(Duration::from_secs(2)).ok();
                let offsets = |list: Option<rdkafka::TopicPartitionList>| {
                    list.map(|list| {
                        list.elements()
                            .iter()
                            .map(|element| (element.partition(), element.offset()))
                            .collect::<Vec<_>>()
                    })
                };
                if offsets(position) == offsets(committed) {
                    break;
                }
            }
            let _ = finished.send(());
        });
    }
}

/// Consumes stream `name` through a durable pull consumer, `channels` pulls at a time,
/// sending the time of each ack to `counted`.
async fn consume_stream(
    name: &str,
    prefetch: u16,
    channels: u16,
    counted: tokio::sync::mpsc::UnboundedSender<Instant>,
) {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_string());
    let client = async_nats::connect(url.as_str())
        .await
        .unwrap_or_else(|error| {
            eprintln!("raw-consume: cannot connect to NATS at {url}: {error}");
            std::process::exit(1)
        });
    let context = jetstream::new(client);
    let consumer = context
        .create_consumer_on_stream(
            pull::Config {
                durable_name: Some("raw-consume".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ..pull::Config::default()
            },
            name,
        )
        .await
        .unwrap_or_else(|error| {
            eprintln!("raw-consume: cannot create a consumer on stream {name}: {error}");
            std::process::exit(1)
        });
    for _ in 0..channels {
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(usize::from(prefetch))
            .messages()
            .await
            .expect("pull");
        let counted = counted.clone();
        tokio::spawn(async move {
            while let Some(Ok(message)) = messages.next().await {
                if message.ack().await.is_err() || counted.send(Instant::now()).is_err() {
                    break;
                }
            }
        });
    }
}
