//! A hostile producer: on good orders, every header and property idem reads or passes on
//! (`x-idem-*`, `traceparent`, `tracestate`, the message id, the content type, the routing key
//! or subject) set with NUL, control characters, invalid UTF-8, 64 KB and numeric overflows,
//! through the receipts pipeline (an outbox row per order, delivered over HTTP), on both
//! sources, one message a transaction and batches of 64. The producer's input is data: the
//! pipeline never stalls, every order is applied once and its receipt delivered with headers
//! a request can carry, and nothing is dead-lettered or parked.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::{
    BasicPublishOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use idem_e2e::jetstream::TestStream;
use idem_e2e::{Deliveries, TestEnv, order, plugin_path, recording_destination, wait_for};
use idem_host::config::Config;

const ORDERS: i64 = 48;
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// A text header of arbitrary bytes.
fn bytes(value: &[u8]) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.to_vec()))
}

fn text(value: &str) -> AMQPValue {
    bytes(value.as_bytes())
}

/// The hostile headers of order `n` (RabbitMQ), one case of the corpus each, in turn.
fn amqp_case(n: i64) -> (Vec<(&'static str, AMQPValue)>, BasicProperties) {
    let huge = "x".repeat(64 * 1024);
    let long_state = format!("k={}", "v".repeat(10 * 1024));
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type(ShortString::from("application/json"));
    let headers: Vec<(&'static str, AMQPValue)> = match n % 16 {
        0 => vec![
            ("traceparent", text(TRACEPARENT)),
            ("tracestate", text("k=v\0")),
        ],
        1 => vec![
            ("traceparent", text(TRACEPARENT)),
            ("tracestate", text("k=v\n")),
        ],
        2 => vec![
            ("traceparent", text(TRACEPARENT)),
            ("tracestate", text(&long_state)),
        ],
        3 => vec![
            ("traceparent", text(TRACEPARENT)),
            ("tracestate", bytes(&[b'k', b'=', 0xff, 0xfe])),
        ],
        // Both under the broker's frame size (128 KiB for all the headers).
        4 => vec![
            ("traceparent", text(&huge[..32 * 1024])),
            ("tracestate", text(&huge)),
        ],
        5 => vec![("traceparent", text("00-\0-\u{1}-01"))],
        6 => vec![("x-idem-attempt", text("99999999999999999999999"))],
        7 => vec![("x-idem-attempt", AMQPValue::LongLongInt(i64::MIN))],
        8 => vec![
            ("x-idem-replays", AMQPValue::LongLongInt(i64::MAX)),
            ("x-idem-rejected-at", text("10000000000000000000")),
        ],
        9 => vec![
            ("x-idem-reason", text(&format!("\0{huge}"))),
            ("x-idem-error-kind", bytes(&[0xff; 300])),
        ],
        10 => vec![
            ("x-idem-dead-letter-id", text("\0\n")),
            ("x-idem-expiration", text("-1")),
        ],
        11 => {
            properties = properties.with_message_id(ShortString::from("id\0\n\u{1b}[31m"));
            vec![]
        }
        12 => {
            properties = properties
                .with_content_type(ShortString::from("application/json\0\r\n"))
                .with_correlation_id(ShortString::from("é".repeat(127)));
            vec![("content-type", text("\0"))]
        }
        13 => vec![
            ("x-idem-attempt", AMQPValue::Double(-1e308)),
            ("x-idem-user-id", text(&huge)),
        ],
        14 => vec![
            ("\u{1}weird name", text("\u{7f}")),
            ("x-idem-queue", AMQPValue::Void),
        ],
        _ => vec![],
    };
    (headers, properties)
}

/// Publishes order `n` with its hostile case through `exchange` (bound to the test's queue
/// whatever the routing key), its routing key hostile too.
async fn publish_amqp(env: &TestEnv, exchange: &str, n: i64) {
    let (headers, properties) = amqp_case(n);
    let mut table = FieldTable::default();
    for (name, value) in headers {
        table.insert(ShortString::from(name), value);
    }
    let routing_key = match n % 3 {
        0 => "orders\0\n\u{1}".to_string(),
        1 => "é".repeat(127),
        _ => "orders".to_string(),
    };
    let confirm = env
        .channel
        .basic_publish(
            ShortString::from(exchange),
            ShortString::from(routing_key),
            BasicPublishOptions::default(),
            &order(n, n % 7, 1_000 + n),
            properties.with_headers(table),
        )
        .await
        .expect("publish")
        .await
        .expect("publish confirm");
    assert!(confirm.is_ack(), "the broker refused order {n}");
}

/// A fanout exchange of the test's, bound to its queue.
async fn fanout(env: &TestEnv) -> String {
    let exchange = format!("{}.hostile", env.queue);
    env.channel
        .exchange_declare(
            ShortString::from(exchange.as_str()),
            lapin::ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare exchange");
    env.channel
        .queue_bind(
            ShortString::from(env.queue.as_str()),
            ShortString::from(exchange.as_str()),
            ShortString::from(""),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind queue");
    exchange
}

/// The hostile headers of order `n` (JetStream): what a NATS client lets a producer send.
fn nats_case(n: i64) -> Vec<(&'static str, String)> {
    let huge = "x".repeat(64 * 1024);
    match n % 10 {
        0 => vec![
            ("traceparent", TRACEPARENT.into()),
            ("tracestate", "k=v\0".into()),
        ],
        1 => vec![
            ("traceparent", TRACEPARENT.into()),
            ("tracestate", "k=\u{1}v".into()),
        ],
        2 => vec![
            ("traceparent", TRACEPARENT.into()),
            ("tracestate", format!("k={huge}")),
        ],
        3 => vec![("traceparent", huge.clone())],
        4 => vec![("x-idem-attempt", "99999999999999999999999".into())],
        5 => vec![
            ("x-idem-replays", "-1".into()),
            ("x-idem-rejected-at", u64::MAX.to_string()),
        ],
        6 => vec![("Nats-Msg-Id", format!("id-{n}-\0\u{1}-{}", "é".repeat(500)))],
        7 => vec![
            ("x-idem-reason", format!("\0{huge}")),
            ("x-idem-subject", "\0".into()),
        ],
        8 => vec![
            ("content-type", "\0\u{1}".into()),
            ("x-idem-message-id", huge.clone()),
        ],
        _ => vec![],
    }
}

async fn publish_nats(stream: &TestStream, n: i64) {
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in nats_case(n) {
        headers.insert(name, value.as_str());
    }
    let subject = match n % 3 {
        0 => format!("{}.é.{}", stream.name, "t".repeat(200)),
        1 => format!("{}.orders.\u{1}", stream.name),
        _ => stream.subject.clone(),
    };
    let stored = async {
        stream
            .context
            .publish_with_headers(
                subject,
                headers,
                bytes::Bytes::from(order(n, n % 7, 1_000 + n)),
            )
            .await
            .ok()?
            .await
            .ok()
    };
    if tokio::time::timeout(Duration::from_secs(5), stored)
        .await
        .ok()
        .flatten()
        .is_none()
    {
        // A header or subject the client or server refuses never reaches idem: sent plain.
        stream.publish(&order(n, n % 7, 1_000 + n), None).await;
    }
}

fn receipts_pipeline(source: &str, batch: usize, extra: &str) -> String {
    format!(
        r#"
[outbox]
poll = "50ms"
max_attempts = 3

[outbox.destinations.receipts]
kind = "http"
url = "http://127.0.0.1:{{port}}/receipts"

[pipelines.receipts]
plugin = "{plugin}"
workers = 4
{extra}
source = {source}

[pipelines.receipts.batch]
size = {batch}
linger = "20ms"

[pipelines.receipts.statements]
record_receipt = "INSERT INTO receipts (order_id, customer_id, total_cents) VALUES ($1, $2, $3)"
"#,
        plugin = plugin_path("receipts").display(),
    )
}

/// Every order applied once, its receipt delivered with a `tracestate` a header can hold,
/// nothing dead-lettered or parked.
async fn check_every_order(env: &TestEnv, delivered: &Deliveries) {
    wait_for("every order applied", Duration::from_secs(90), || async {
        env.count("SELECT count(*) FROM receipts").await == ORDERS
    })
    .await;
    wait_for(
        "every receipt delivered",
        Duration::from_secs(60),
        || async {
            delivered.lock().expect("deliveries").len() as i64 == ORDERS
                && env
                    .count("SELECT count(*) FROM idem_outbox WHERE delivered_at IS NULL")
                    .await
                    == 0
        },
    )
    .await;
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        ORDERS
    );
    assert_eq!(
        env.count("SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL")
            .await,
        0,
        "a receipt was parked"
    );
    let delivered = delivered.lock().expect("deliveries");
    for n in 0..ORDERS {
        let deliveries = delivered
            .get(&format!("receipt:{n}"))
            .unwrap_or_else(|| panic!("receipt {n} not delivered: {delivered:?}"));
        for headers in deliveries {
            let state = headers
                .get("tracestate")
                .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
                .unwrap_or_default();
            assert!(
                state.len() <= 512 && state.bytes().all(|byte| (0x20..0x7f).contains(&byte)),
                "receipt {n} carried tracestate {state:?}"
            );
        }
    }
}

async fn rabbitmq(batch: usize) {
    let env = TestEnv::new(&format!("hostile_amqp_{batch}")).await;
    let (port, delivered) = recording_destination().await;
    let source = format!(
        "{{ kind = \"rabbitmq\", queue = \"{}\", dead_letter_queue = \"{}\" }}",
        env.queue, env.dead_letter_queue
    );
    let text = format!(
        "{}{}",
        env.config_header(),
        receipts_pipeline(&source, batch, "prefetch = 128").replace("{port}", &port.to_string())
    );
    let config = Config::from_toml(std::path::Path::new("/tmp/hostile.toml"), &text)
        .unwrap_or_else(|error| panic!("{error}\n{text}"));
    let exchange = fanout(&env).await;
    for n in 0..ORDERS {
        publish_amqp(&env, &exchange, n).await;
    }
    let host = env.start_host(config);
    check_every_order(&env, &delivered).await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    let _ = env
        .channel
        .exchange_delete(
            ShortString::from(exchange.as_str()),
            ExchangeDeleteOptions::default(),
        )
        .await;
    env.cleanup().await;
}

async fn jetstream(batch: usize) {
    let env = TestEnv::new(&format!("hostile_js_{batch}")).await;
    let stream = TestStream::new(&env.queue).await;
    let (port, delivered) = recording_destination().await;
    let source = format!(
        "{{ kind = \"jetstream\", servers = [\"{}\"], stream = \"{}\", subject = \"{}.>\", \
         dead_letter_subject = \"{}\", dead_letter_stream = \"{}\" }}",
        stream.url, stream.name, stream.name, stream.dead_letter_subject, stream.dead_letter_stream
    );
    let text = format!(
        "{}{}",
        env.config_header(),
        receipts_pipeline(&source, batch, "prefetch = 128\nconsumer = \"receipts\"")
            .replace("{port}", &port.to_string())
    );
    let config = Config::from_toml(std::path::Path::new("/tmp/hostile.toml"), &text)
        .unwrap_or_else(|error| panic!("{error}\n{text}"));
    for n in 0..ORDERS {
        publish_nats(&stream, n).await;
    }
    let host = env.start_host(config);
    check_every_order(&env, &delivered).await;
    host.stop().await.expect("host stops cleanly");
    assert!(stream.dead_letters().await.is_empty(), "dead letters");
    stream.cleanup().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_producer_on_rabbitmq_stalls_nothing_one_at_a_time() {
    rabbitmq(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_producer_on_rabbitmq_stalls_nothing_in_batches() {
    rabbitmq(64).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_producer_on_jetstream_stalls_nothing_one_at_a_time() {
    jetstream(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_producer_on_jetstream_stalls_nothing_in_batches() {
    jetstream(64).await;
}
