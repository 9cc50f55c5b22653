//! OpenTelemetry traces end to end: a producer's `traceparent` parents the message's span,
//! which parents the outbox delivery's span, whose context reaches the destination; spans
//! exported over OTLP to a receiver the test runs, with gRPC (turned on by the standard
//! variables) and HTTP/protobuf (by the `[traces]` table).

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::HeaderMap;

use idem_e2e::otlp::{OtlpReceiver, ReceivedSpan, Transport};
use std::process::{Command, Stdio};

use idem_e2e::{
    IdemProcess, TestEnv, idem_binary, order, publish_with_headers, recording_destination,
    spawn_idem, wait_for,
};

const CONSUMER: i32 = 5;
const PRODUCER: i32 = 4;
const ERROR: i32 = 2;

/// A producer's trace: the trace id and the id of the span that published.
struct Produced {
    trace_id: &'static str,
    span_id: &'static str,
}

impl Produced {
    fn traceparent(&self, flags: &str) -> String {
        format!("00-{}-{}-{flags}", self.trace_id, self.span_id)
    }
}

const SAMPLED: Produced = Produced {
    trace_id: "4bf92f3577b34da6a3ce929d0e0e4736",
    span_id: "00f067aa0ba902b7",
};
const NOT_SAMPLED: Produced = Produced {
    trace_id: "0af7651916cd43dd8448eb211c80319c",
    span_id: "b7ad6b7169203331",
};

/// Publishes the three orders of the scenario: one in a sampled trace (with vendor state),
/// one in a trace the producer did not sample, one with no trace (its span is a root), and
/// one whose `traceparent` is malformed (ignored: a root too).
async fn publish_orders(env: &TestEnv) {
    let sampled = SAMPLED.traceparent("01");
    let not_sampled = NOT_SAMPLED.traceparent("00");
    publish_with_headers(
        &env.channel,
        &env.queue,
        &order(1, 1, 1_000),
        &[("traceparent", &sampled), ("tracestate", "vendor=opaque")],
    )
    .await;
    publish_with_headers(
        &env.channel,
        &env.queue,
        &order(2, 1, 1_000),
        &[("traceparent", &not_sampled)],
    )
    .await;
    publish_with_headers(&env.channel, &env.queue, &order(3, 1, 1_000), &[]).await;
    publish_with_headers(
        &env.channel,
        &env.queue,
        &order(4, 1, 1_000),
        &[("traceparent", "00-not-a-trace-01")],
    )
    .await;
}

/// The message's span and its delivery's, found by the message's key.
fn spans_of<'a>(spans: &'a [ReceivedSpan], key: &str) -> (&'a ReceivedSpan, &'a ReceivedSpan) {
    let message = spans
        .iter()
        .find(|span| span.kind == CONSUMER && span.attribute("idem.key") == Some(key))
        .unwrap_or_else(|| panic!("no message span for {key}: {spans:#?}"));
    let delivery = spans
        .iter()
        .find(|span| span.kind == PRODUCER && span.parent_span_id == message.span_id)
        .unwrap_or_else(|| panic!("no delivery span under {key}'s: {spans:#?}"));
    (message, delivery)
}

/// Checks the links: producer → message span → delivery span → the destination's headers.
fn check_links(spans: &[ReceivedSpan], delivered: &BTreeMap<String, (String, String)>) {
    // 1: the producer's sampled trace.
    let (message, delivery) = spans_of(spans, "receipt:1");
    assert_eq!(message.trace_id, SAMPLED.trace_id, "{message:#?}");
    assert_eq!(message.parent_span_id, SAMPLED.span_id, "{message:#?}");
    assert_eq!(message.service, "idem-traces-test");
    assert_eq!(message.attribute("pipeline"), Some("receipts"));
    assert_eq!(message.attribute("messaging.system"), Some("rabbitmq"));
    assert_eq!(
        message.attribute("messaging.operation.type"),
        Some("process")
    );
    // A RabbitMQ queue has no consumer group.
    assert_eq!(message.attribute("messaging.consumer.group.name"), None);
    assert_eq!(delivery.attribute("messaging.operation.type"), Some("send"));
    assert_eq!(message.attribute("idem.outcome"), Some("applied"));
    assert!(
        message
            .attribute("idem.plugin.digest")
            .is_some_and(|digest| digest.len() >= 16),
        "{message:#?}"
    );
    assert!(
        message
            .attribute("idem.transaction.duration_ms")
            .and_then(|ms| ms.parse::<f64>().ok())
            .is_some_and(|ms| ms > 0.0),
        "{message:#?}"
    );
    assert_eq!(message.attribute("idem.transaction.tries"), Some("1"));
    assert_eq!(delivery.trace_id, SAMPLED.trace_id);
    assert_eq!(
        delivered.get("receipt:1"),
        Some(&(
            format!("00-{}-{}-01", SAMPLED.trace_id, delivery.span_id),
            "vendor=opaque".to_string()
        )),
        "the destination gets the delivery span's context"
    );
    // 2: not sampled by its producer: no span exported, the trace still handed on.
    assert!(
        spans
            .iter()
            .all(|span| span.trace_id != NOT_SAMPLED.trace_id),
        "spans of an unsampled trace were exported"
    );
    let (traceparent, _) = delivered.get("receipt:2").expect("receipt 2 delivered");
    assert!(
        traceparent.starts_with(&format!("00-{}-", NOT_SAMPLED.trace_id))
            && traceparent.ends_with("-00"),
        "{traceparent}"
    );
    // 3 and 4: no trace, or a malformed one: the message span starts a trace.
    for key in ["receipt:3", "receipt:4"] {
        let (message, delivery) = spans_of(spans, key);
        assert!(message.parent_span_id.is_empty(), "{message:#?}");
        assert_eq!(delivery.trace_id, message.trace_id);
        assert_eq!(
            delivered.get(key).map(|(parent, _)| parent.as_str()),
            Some(format!("00-{}-{}-01", message.trace_id, delivery.span_id).as_str()),
        );
    }
    assert!(spans.iter().all(|span| span.status_code != ERROR));
}

/// gRPC, turned on by `OTEL_EXPORTER_OTLP_ENDPOINT` and `OTEL_EXPORTER_OTLP_PROTOCOL`; an
/// HTTP destination. The host logs JSON: a message's log line carries its trace and span ids
/// at the top level, the ids of the exported span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_runs_from_the_producer_through_idem_to_an_http_delivery_over_grpc() {
    let env = TestEnv::new("traces_grpc").await;
    let receiver = OtlpReceiver::start(Transport::Grpc).await;
    let (port, delivered) = recording_destination().await;
    let config = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(
        &config,
        crate::outbox::receipts_config(
            &env,
            &format!(
                "[outbox.destinations.receipts]\nkind = \"http\"\nurl = \"http://127.0.0.1:{port}/receipts\""
            ),
        ),
    )
    .expect("write config");
    let endpoint = receiver.endpoint();
    let log = std::env::temp_dir().join(format!("{}.log", env.database));
    let host = IdemProcess::spawn(
        Command::new(idem_binary())
            .args(["run", "--config"])
            .arg(&config)
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .envs([
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", Transport::Grpc.protocol()),
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
                ("OTEL_SERVICE_NAME", "idem-traces-test"),
                ("IDEM_LOG_FORMAT", "json"),
                ("RUST_LOG", "idem_host=debug,warn"),
            ]),
    );
    publish_orders(&env).await;
    wait_for("4 receipts delivered", Duration::from_secs(60), || async {
        delivered.lock().expect("deliveries").len() == 4
    })
    .await;
    assert!(host.terminate().success(), "idem exits cleanly");
    // The context each receipt's last delivery carried.
    let text = |headers: &HeaderMap, name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let delivered: BTreeMap<String, (String, String)> = delivered
        .lock()
        .expect("deliveries")
        .iter()
        .filter_map(|(key, deliveries)| {
            let last = deliveries.last()?;
            Some((
                key.clone(),
                (text(last, "traceparent"), text(last, "tracestate")),
            ))
        })
        .collect();
    let spans = receiver.spans();
    check_links(&spans, &delivered);
    let (message, _) = spans_of(&spans, "receipt:1");
    let logged = std::fs::read_to_string(&log).expect("the host's log");
    let applied: serde_json::Value = logged
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("a JSON line"))
        .find(|line| line["message"] == "Applied." && line["key"] == "receipt:1")
        .unwrap_or_else(|| panic!("no \"Applied.\" line for receipt:1: {logged}"));
    assert_eq!(applied["trace_id"], SAMPLED.trace_id, "{applied}");
    assert_eq!(applied["span_id"], message.span_id.as_str(), "{applied}");
    assert_eq!(applied["pipeline"], "receipts", "{applied}");
    let _ = std::fs::remove_file(log);
    env.cleanup().await;
}

/// HTTP/protobuf, turned on by the `[traces]` table; an AMQP destination, whose messages
/// carry the context in their headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_runs_from_the_producer_through_idem_to_an_amqp_delivery_over_http() {
    let env = TestEnv::new("traces_http").await;
    let receiver = OtlpReceiver::start(Transport::HttpProtobuf).await;
    let (exchange, target) = crate::outbox::receipts_exchange(&env).await;
    let config = std::env::temp_dir().join(format!("{}.toml", env.database));
    let text = crate::outbox::receipts_config(
        &env,
        &format!(
            "[outbox.destinations.receipts]\nkind = \"amqp\"\nexchange = \"{exchange}\"\nrouting_key = \"receipt.issued\"\n\n[traces]\notlp_endpoint = \"{}\"\nprotocol = \"http/protobuf\"",
            receiver.endpoint()
        ),
    );
    std::fs::write(&config, text).expect("write config");
    let host = spawn_idem(
        &config,
        &[
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_RESOURCE_ATTRIBUTES", "service.name=idem-traces-test"),
        ],
    );
    publish_orders(&env).await;
    wait_for("4 receipts published", Duration::from_secs(60), || async {
        env.ready(&target).await == 4
    })
    .await;
    assert!(host.terminate().success(), "idem exits cleanly");
    let header = |headers: &[(String, String)], name: &str| {
        headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
            .unwrap_or_default()
    };
    let delivered: BTreeMap<String, (String, String)> = env
        .drain(&target)
        .await
        .into_iter()
        .map(|(_, headers)| {
            (
                header(&headers, "idempotency-key"),
                (
                    header(&headers, "traceparent"),
                    header(&headers, "tracestate"),
                ),
            )
        })
        .collect();
    check_links(&receiver.spans(), &delivered);
    crate::outbox::delete_exchange(&env, &exchange).await;
    env.cleanup().await;
}
