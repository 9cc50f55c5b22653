//! The loyalty consumer on a NATS JetStream stream (the machine's nats-server, JetStream on):
//! every order credited once through duplicates, rejected messages kept on the dead-letter
//! subject with their reasons, and the durable consumer left with nothing pending.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_e2e::jetstream::{NatsServer, TestStream};
use idem_e2e::tls::{self, Pki};
use idem_e2e::{
    TestEnv, free_port, must_refuse, order, pipeline_table, plugin_path, run_and_check_refuse,
    spawn_idem, wait_for,
};
use idem_host::config::Config;

/// The config text of a host serving `plugin` as pipeline `loyalty` from `stream`.
pub(crate) fn config_text(
    env: &TestEnv,
    stream: &TestStream,
    plugin: &str,
    source_extra: &str,
    extra: &str,
) -> String {
    format!(
        "{}{}",
        env.config_header(),
        stream.pipeline_table("loyalty", &plugin_path(plugin), source_extra, extra)
    )
}

pub(crate) fn parse(text: &str) -> Config {
    Config::from_toml(Path::new("/tmp/idem-jetstream-test.toml"), text)
        .unwrap_or_else(|error| panic!("{error}\n{text}"))
}

/// The config of a host serving the loyalty plugin from `stream`.
fn config(env: &TestEnv, stream: &TestStream, source_extra: &str, extra: &str) -> Config {
    parse(&config_text(env, stream, "loyalty", source_extra, extra))
}

/// Waits until the consumer has delivered and had acknowledged every message.
async fn wait_drained(stream: &TestStream) {
    wait_drained_by(stream, "idem-loyalty").await;
}

async fn wait_drained_by(stream: &TestStream, consumer: &str) {
    wait_for(
        "the consumer to hold nothing",
        Duration::from_secs(90),
        || async { stream.consumer_counts(consumer).await == Some((0, 0)) },
    )
    .await;
}

/// 2,000 orders and 400 duplicates of them (published by two publishers at once, each copy
/// with its own message id so the stream keeps it): every order is credited once, and the
/// consumer ends with nothing pending and nothing unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_duplicates_credits_every_order_once() {
    let env = TestEnv::new("js_loyalty").await;
    let stream = Arc::new(TestStream::new(&env.queue).await);
    let host = env.start_host(config(&env, &stream, "", ""));
    const ORDERS: i64 = 2_000;
    let publishers: Vec<_> = (0..2)
        .map(|publisher| {
            let stream = Arc::clone(&stream);
            tokio::spawn(async move {
                for order_id in (publisher..ORDERS).step_by(2) {
                    let body = order(order_id, order_id % 97, 1_000 + order_id);
                    stream
                        .publish(&body, Some(&format!("order-{order_id}")))
                        .await;
                    if order_id % 5 == 0 {
                        // The same event again, as a producer retrying would send it: the
                        // stream keeps it (another message id), idem must not credit it again.
                        stream
                            .publish(&body, Some(&format!("order-{order_id}-again")))
                            .await;
                    }
                }
            })
        })
        .collect();
    for publisher in publishers {
        publisher.await.expect("publisher");
    }
    wait_for("every order credited", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == ORDERS
    })
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    let duplicates = env
        .count("SELECT count(*) FROM processed_messages WHERE consumer = 'loyalty'")
        .await;
    assert_eq!(duplicates, ORDERS, "one claim per order");
    assert!(stream.dead_letters().await.is_empty(), "nothing rejected");
    Arc::into_inner(stream)
        .expect("publishers done")
        .cleanup()
        .await;
    env.cleanup().await;
}

/// Malformed messages land on the dead-letter subject, each with its reason and kind, and are
/// terminated on the stream; the good orders beside them are credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_messages_land_on_the_dead_letter_subject_with_their_reasons() {
    let env = TestEnv::new("js_poison").await;
    let stream = TestStream::new(&env.queue).await;
    let host = env.start_host(config(&env, &stream, "", ""));
    stream.publish(&order(1, 7, 5_000), None).await;
    stream.publish(b"not json", Some("bad-1")).await;
    stream
        .publish(br#"{"type":"OrderCompleted","order_id":2}"#, Some("bad-2"))
        .await;
    stream
        .publish(
            br#"{"type":"OrderCompleted","order_id":3,"customer_id":7,"total_cents":-5}"#,
            Some("bad-3"),
        )
        .await;
    stream.publish(&order(4, 7, 1_000), None).await;
    wait_for("three dead letters", Duration::from_secs(60), || async {
        stream.dead_letters().await.len() == 3
    })
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 2);
    let letters = stream.dead_letters().await;
    let header = |headers: &[(String, String)], name: &str| {
        headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
            .unwrap_or_else(|| panic!("{name} missing from {headers:?}"))
    };
    let mut reasons: Vec<(String, String, String)> = letters
        .iter()
        .map(|(_, headers)| {
            (
                header(headers, "Nats-Msg-Id"),
                header(headers, "x-idem-error-kind"),
                header(headers, "x-idem-reason"),
            )
        })
        .collect();
    reasons.sort();
    let ids: Vec<&str> = reasons.iter().map(|(id, _, _)| id.as_str()).collect();
    assert!(
        ids.iter().all(|id| id.starts_with("idem-dead-letter:")),
        "{ids:?}"
    );
    assert!(
        reasons.iter().all(|(_, kind, _)| kind == "invalid-input"),
        "{reasons:?}"
    );
    let all: String = reasons
        .iter()
        .map(|(_, _, reason)| reason.as_str())
        .collect::<Vec<_>>()
        .join(" | ");
    for expected in ["JSON", "customer_id", "negative"] {
        assert!(all.contains(expected), "{expected} not in {all}");
    }
    stream.cleanup().await;
    env.cleanup().await;
}

/// Another pipeline's host, updating the shared dead-letter stream from a config it read
/// before this host added its subject, drops that subject after this host started: the
/// next dead letter finds no stream, so the host makes the stream capture its subject again
/// and stores it (review finding 9), instead of giving the message back forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_subject_dropped_by_another_host_is_captured_again() {
    let env = TestEnv::new("js_recapture").await;
    let stream = TestStream::new(&env.queue).await;
    let host = env.start_host(config(&env, &stream, "", ""));
    stream.publish(&order(1, 7, 5_000), None).await;
    wait_for("the first order", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1
    })
    .await;
    let mut dead_letters = stream
        .context
        .get_stream(&stream.dead_letter_stream)
        .await
        .expect("the dead-letter stream the host made");
    let mut changed = dead_letters.info().await.expect("info").config.clone();
    assert_eq!(changed.subjects, vec![stream.dead_letter_subject.clone()]);
    changed.subjects = vec![format!("{}-other.rejected", stream.name)];
    stream
        .context
        .update_stream(&changed)
        .await
        .expect("another host's update");

    stream.publish(b"not json", Some("bad-1")).await;
    stream.publish(&order(2, 7, 1_000), None).await;
    wait_for(
        "the dead letter stored",
        Duration::from_secs(60),
        || async { stream.dead_letters().await.len() == 1 },
    )
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 2);
    let subjects = dead_letters
        .info()
        .await
        .expect("info")
        .config
        .subjects
        .clone();
    assert!(
        subjects.contains(&stream.dead_letter_subject)
            && subjects.contains(&format!("{}-other.rejected", stream.name)),
        "{subjects:?}"
    );
    stream.cleanup().await;
    env.cleanup().await;
}

/// A plugin failure marked retryable comes back after the retry delay (a negative ack with a
/// delay: the server counts the deliveries) and is dead-lettered after `max_attempts`; a trap
/// is dead-lettered at once; orders beside them are credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_failures_come_back_then_are_dead_lettered_after_max_attempts() {
    let env = TestEnv::new("js_retry").await;
    let stream = TestStream::new(&env.queue).await;
    let host = env.start_host(parse(&config_text(
        &env,
        &stream,
        "chaos",
        "",
        "max_attempts = 3",
    )));
    let echo = |order_id: i64| {
        serde_json::json!({
            "key": format!("order-completed:{order_id}"),
            "effects": [
                {"statement": "credit_balance", "params": [1, 10]},
                {"statement": "record_ledger", "params": [1, order_id, 10]},
            ]
        })
        .to_string()
        .into_bytes()
    };
    let started = Instant::now();
    stream.publish(&echo(1), None).await;
    stream
        .publish(br#"{"action": "retry"}"#, Some("retry-1"))
        .await;
    stream
        .publish(br#"{"action": "trap"}"#, Some("trap-1"))
        .await;
    stream.publish(&echo(2), None).await;
    wait_for("two dead letters", Duration::from_secs(60), || async {
        stream.dead_letters().await.len() == 2
    })
    .await;
    // Tries 2 and 3 came after 200 ms and 400 ms: the server held the message that long.
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "retried sooner than the delays allow: {:?}",
        started.elapsed()
    );
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    let letters = stream.dead_letters().await;
    let letter = |id: &str| {
        letters
            .iter()
            .find(|(_, headers)| {
                headers
                    .iter()
                    .any(|(name, value)| name == "x-idem-message-id" && value == id)
            })
            .map(|(_, headers)| headers.clone())
            .unwrap_or_else(|| panic!("no dead letter for {id}: {letters:?}"))
    };
    let value = |headers: &[(String, String)], name: &str| {
        headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
            .unwrap_or_default()
    };
    let retried = letter("retry-1");
    assert_eq!(value(&retried, "x-idem-error-kind"), "retries-exhausted");
    assert!(
        value(&retried, "x-idem-reason").contains("gave up after 3 attempts"),
        "{retried:?}"
    );
    assert_eq!(value(&letter("trap-1"), "x-idem-error-kind"), "plugin-trap");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 2);
    stream.cleanup().await;
    env.cleanup().await;
}

/// One host serves a RabbitMQ pipeline and a JetStream pipeline side by side, each crediting
/// its own orders once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_host_serves_a_queue_and_a_stream_side_by_side() {
    let env = TestEnv::new("js_side").await;
    let stream = TestStream::new(&env.queue).await;
    let text = format!(
        "{}{}{}",
        env.config_header(),
        pipeline_table(
            "loyalty",
            &env.queue,
            &env.dead_letter_queue,
            &plugin_path("loyalty"),
            ""
        ),
        stream.pipeline_table("stream-loyalty", &plugin_path("loyalty"), "", "")
    );
    let host = env.start_host(parse(&text));
    for order_id in 0..200 {
        env.publish(&order(order_id, order_id % 7, 1_000)).await;
        stream
            .publish(&order(10_000 + order_id, order_id % 7, 1_000), None)
            .await;
    }
    wait_for("every order credited", Duration::from_secs(90), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 400
    })
    .await;
    wait_drained_by(&stream, "idem-stream-loyalty").await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(
        env.count("SELECT count(DISTINCT order_id) FROM point_ledger")
            .await,
        400
    );
    for consumer in ["loyalty", "stream-loyalty"] {
        assert_eq!(
            env.count(&format!(
                "SELECT count(*) FROM processed_messages WHERE consumer = '{consumer}'"
            ))
            .await,
            200,
            "claims of {consumer}"
        );
    }
    stream.cleanup().await;
    env.cleanup().await;
}

/// Crash windows: the real binary aborts before the commit, or after it and before the ack,
/// on the first of 20 orders; a restarted host credits every order once (the message comes
/// back after `ack_wait`, and after the commit the claim makes it a duplicate).
async fn crash_then_restart(name: &str, failpoint: &str) {
    let env = TestEnv::new(name).await;
    let stream = TestStream::new(&env.queue).await;
    let text = config_text(&env, &stream, "loyalty", ", ack_wait = \"2s\"", "");
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, &text).expect("write config");
    let mut child = spawn_idem(&path, &[("IDEM_FAILPOINT", failpoint)]);
    for order_id in 0..20 {
        stream.publish(&order(order_id, 3, 100), None).await;
    }
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait on idem") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "idem did not reach {failpoint}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!status.success(), "idem should have aborted at {failpoint}");
    let host = env.start_host(parse(&text));
    wait_for("every order credited", Duration::from_secs(90), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 20
    })
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    assert_eq!(
        env.count("SELECT coalesce(sum(points), 0)::int8 FROM balances")
            .await,
        20,
        "each order's point once"
    );
    assert!(stream.dead_letters().await.is_empty());
    let _ = std::fs::remove_file(path);
    stream.cleanup().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_commit_loses_nothing() {
    crash_then_restart("js_crash_before", "before-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_commit_before_the_ack_doubles_nothing() {
    crash_then_restart("js_crash_after", "after-commit").await;
}

/// A transaction slower than `ack_wait` (a trigger sleeping 3 s, `ack_wait` 1 s), with two
/// hosts on the consumer. Without in-progress acks the server delivers the message again to
/// the other host while the first still holds it, and the claim makes that copy a duplicate:
/// applied once. With in-progress acks the server waits: no second delivery at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_slower_than_ack_wait_is_applied_once() {
    for in_progress in [false, true] {
        let env = TestEnv::new(&format!("js_slow_{in_progress}")).await;
        env.slow_ledger("true", 3.0).await;
        let stream = TestStream::new(&env.queue).await;
        let text = config_text(
            &env,
            &stream,
            "loyalty",
            &format!(", ack_wait = \"1s\", in_progress = {in_progress}"),
            "",
        );
        let metrics: Vec<Arc<idem_host::telemetry::metrics::Metrics>> = (0..2)
            .map(|_| Arc::new(idem_host::telemetry::metrics::Metrics::new()))
            .collect();
        let hosts: Vec<_> = metrics
            .iter()
            .map(|metrics| env.start_host_with_metrics(parse(&text), Arc::clone(metrics)))
            .collect();
        stream.publish(&order(7, 1, 700), None).await;
        wait_for("the order credited", Duration::from_secs(60), || async {
            env.count("SELECT count(*) FROM point_ledger").await == 1
        })
        .await;
        wait_drained(&stream).await;
        let settled = |outcome| {
            metrics
                .iter()
                .map(|metrics| metrics.messages("loyalty", outcome))
                .sum::<u64>()
        };
        // Settling is counted after the ack: wait for every delivery's count.
        wait_for(
            "the deliveries settled",
            Duration::from_secs(30),
            || async { settled("applied") == 1 && (in_progress || settled("duplicate") >= 1) },
        )
        .await;
        for host in hosts {
            host.stop().await.expect("host stops cleanly");
        }
        if in_progress {
            assert_eq!(
                settled("duplicate"),
                0,
                "delivered again despite in-progress acks"
            );
        }
        assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 1);
        env.assert_loyalty_consistent().await;
        stream.cleanup().await;
        env.cleanup().await;
    }
}

/// Runs `idem <command> --config <path>`; its exit success and its output.
fn idem_command(command: &str, path: &Path) -> (bool, String) {
    let output = std::process::Command::new(idem_e2e::idem_binary())
        .args([command, "--config"])
        .arg(path)
        // The commands' own log level, not the test runner's.
        .env_remove("RUST_LOG")
        .output()
        .expect("run idem");
    (output.status.success(), idem_e2e::said(&output))
}

/// `idem check` looks at the stream and the consumer without creating them, refuses a
/// consumer that differs from the config or is missing with `declare = false`, naming the
/// setting; `idem status` reports the stream's counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_status_look_at_the_stream_and_its_consumer() {
    let env = TestEnv::new("js_check").await;
    let stream = TestStream::new(&env.queue).await;
    let write = |source_extra: &str| {
        let path =
            std::env::temp_dir().join(format!("{}-{}.toml", env.database, source_extra.len()));
        std::fs::write(
            &path,
            config_text(&env, &stream, "loyalty", source_extra, ""),
        )
        .expect("write config");
        path
    };
    let plain = write("");
    let (ok, output) = idem_command("check", &plain);
    assert!(ok, "{output}");
    assert!(output.contains("will be created by idem run"), "{output}");
    assert_eq!(
        stream.consumer_counts("idem-loyalty").await,
        None,
        "check created the consumer"
    );

    let bound = write(", declare = false");
    let (ok, output) = idem_command("check", &bound);
    assert!(!ok, "{output}");
    assert!(
        output.contains("pipelines.loyalty.source.consumer and declare = false"),
        "{output}"
    );

    let host = env.start_host(parse(&config_text(&env, &stream, "loyalty", "", "")));
    stream.publish(&order(1, 2, 300), None).await;
    wait_for("the order credited", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1
    })
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    let (ok, output) = idem_command("check", &plain);
    assert!(ok, "{output}");
    assert!(output.contains("match"), "{output}");
    let (ok, output) = idem_command("status", &plain);
    assert!(ok, "{output}");
    assert!(
        output.contains("1 messages, 0 not delivered, 0 unacknowledged"),
        "{output}"
    );
    // A report and nothing else: not the NATS client's "connected" lines.
    let (_, checked) = idem_command("check", &plain);
    for report in [&output, &checked] {
        assert!(
            !report.contains("INFO") && !report.contains("connected"),
            "{report}"
        );
    }
    // Credentials in a server's URL are never printed.
    let secret = std::env::temp_dir().join(format!("{}-secret.toml", env.database));
    let text = std::fs::read_to_string(&plain).expect("config");
    let url = &stream.url;
    assert!(text.contains(url.as_str()), "{text}");
    std::fs::write(
        &secret,
        text.replace(url.as_str(), "nats://watcher:s3cr3t-pass@127.0.0.1:9"),
    )
    .expect("write config");
    for command in ["check", "status"] {
        let (_, output) = idem_command(command, &secret);
        assert!(output.contains("127.0.0.1:9"), "{output}");
        assert!(!output.contains("s3cr3t-pass"), "{command}: {output}");
    }
    let _ = std::fs::remove_file(secret);
    let other_wait = write(", ack_wait = \"7s\"");
    let (ok, output) = idem_command("check", &other_wait);
    assert!(!ok, "{output}");
    assert!(output.contains("ack_wait 30s (configured 7s)"), "{output}");
    for path in [plain, bound, other_wait] {
        let _ = std::fs::remove_file(path);
    }
    stream.cleanup().await;
    env.cleanup().await;
}

/// The durable consumer deleted under load: the host loses its pull, opens the source again
/// (with backoff), creates the consumer again (`declare`), and every order is credited once.
/// The new consumer delivers the stream from its start, and the claims make the orders
/// already applied duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_consumer_is_created_again_and_nothing_doubles() {
    let env = TestEnv::new("js_deleted").await;
    let stream = TestStream::new(&env.queue).await;
    let host = env.start_host(config(&env, &stream, "", ""));
    for order_id in 0..300 {
        stream
            .publish(&order(order_id, order_id % 11, 100), None)
            .await;
    }
    wait_for("some orders credited", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await >= 100
    })
    .await;
    stream.delete_consumer("idem-loyalty").await;
    for order_id in 300..600 {
        stream
            .publish(&order(order_id, order_id % 11, 100), None)
            .await;
    }
    wait_for("every order credited", Duration::from_secs(90), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 600
    })
    .await;
    wait_drained(&stream).await;
    assert!(!host.is_finished(), "the host stopped");
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    assert!(stream.dead_letters().await.is_empty(), "nothing rejected");
    stream.cleanup().await;
    env.cleanup().await;
}

/// A nats-server of the test's own that requires TLS and a client certificate signed by the
/// test PKI's CA; the PKI and the server's files live in `directory`.
fn mutual_tls_nats_server(directory: &Path) -> (Pki, NatsServer) {
    let pki = Pki::new(directory);
    let config = directory.join("nats.conf");
    std::fs::write(
        &config,
        format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n  timeout: 2\n}}\n",
            pki.server_cert.display(),
            pki.server_key.display(),
            pki.ca.display()
        ),
    )
    .expect("write nats.conf");
    let server = NatsServer::start_with(free_port(), directory.join("store"), Some(config));
    (pki, server)
}

/// A source's `tls` table trusting `ca`, with the PKI's client certificate when `pki` is given.
fn tls_keys(ca: &Path, pki: Option<&Pki>) -> String {
    let client = pki.map_or(String::new(), |pki| {
        format!(
            ", cert_file = \"{}\", key_file = \"{}\"",
            pki.client_cert.display(),
            pki.client_key.display()
        )
    });
    format!(", tls = {{ ca_file = \"{}\"{client} }}", ca.display())
}

/// A stream on a nats-server that requires TLS with a client certificate: with the source's
/// `tls` table (a private CA, a client certificate) `idem check` accepts it and the host
/// credits every order; a CA that did not sign the server's certificate, or no client
/// certificate, stops `idem run` and `idem check` within 10 s naming the source's `tls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_over_mutual_tls_and_its_certificate_faults() {
    let env = TestEnv::new("js_tls").await;
    let directory = std::env::temp_dir().join(format!("{}-nats-tls", env.database));
    let (pki, server) = mutual_tls_nats_server(&directory);
    let url = format!("tls://127.0.0.1:{}", server.port);
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(pki.ca.clone())
        .add_client_certificate(pki.client_cert.clone(), pki.client_key.clone())
        .require_tls(true)
        .connect(url.as_str())
        .await
        .expect("the test's own client over TLS");
    let stream = TestStream::through(client, &url, &env.queue).await;
    let config_path = directory.join("pipelines.toml");
    let write = |source_extra: &str| {
        let text = config_text(&env, &stream, "loyalty", source_extra, "");
        std::fs::write(&config_path, &text).expect("write config");
        text
    };

    let foreign = tls::self_signed_ca(&directory, "foreign-ca", "idem test foreign CA");
    for (case, keys) in [
        ("foreign CA", tls_keys(&foreign, Some(&pki))),
        ("no client certificate", tls_keys(&pki.ca, None)),
    ] {
        write(&keys);
        run_and_check_refuse(&config_path, "pipelines.loyalty.source.tls", case);
    }

    // A credentials file that cannot be read is the operator's to fix, not an outage.
    let missing = directory.join("missing.creds");
    write(&format!(
        "{}, credentials_file = \"{}\"",
        tls_keys(&pki.ca, Some(&pki)),
        missing.display()
    ));
    let output = must_refuse("run", &config_path);
    assert!(
        output.contains("pipelines.loyalty.source.credentials_file"),
        "{output}"
    );

    let text = write(&tls_keys(&pki.ca, Some(&pki)));
    let (ok, output) = idem_command("check", &config_path);
    assert!(ok, "{output}");
    let host = env.start_host(parse(&text));
    for order_id in 1..=100 {
        stream
            .publish(&order(order_id, order_id % 7, 1_000), None)
            .await;
    }
    wait_for("100 credits over TLS", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 100
    })
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    drop(server);
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}

/// A second pipeline subscribing to the same stream (its own durable consumer, every setting
/// at its default): the config text of `loyalty` and `audit` side by side; `audit` writes its
/// own table.
fn two_pipelines_text(env: &TestEnv, stream: &TestStream) -> String {
    let source = |pipeline: &str| {
        format!(
            r#"
[pipelines.{pipeline}]
consumer = "{pipeline}"
plugin = "{plugin}"
source = {{ kind = "jetstream", servers = ["{url}"], stream = "{name}", subject = "{subject}" }}
"#,
            plugin = plugin_path("loyalty").display(),
            url = stream.url,
            name = stream.name,
            subject = stream.subject,
        )
    };
    format!(
        "{header}{loyalty}[pipelines.loyalty.statements]\n{statements}{audit}{audit_statements}",
        header = env.config_header(),
        loyalty = source("loyalty"),
        statements = idem_e2e::LOYALTY_STATEMENTS,
        audit = source("audit"),
        audit_statements = r#"[pipelines.audit.statements]
credit_balance = "SELECT $1::int8, $2::int8"
record_ledger = "INSERT INTO audit_log (customer_id, order_id, points) VALUES ($1, $2, $3)"
"#,
    )
}

/// Two pipelines on one stream both reject the same four malformed messages: each keeps its own
/// dead letters on its own subject (`<stream>_DEAD_LETTERS.<pipeline>`), none is lost or
/// redelivered for ever. With `narrow`, the dead-letter stream exists already capturing only
/// the first pipeline's subject (as an older idem created it): the host makes it capture the
/// second's.
async fn two_pipelines_dead_letter_on_a_shared_stream(name: &str, narrow: bool) {
    let env = TestEnv::new(name).await;
    sqlx::raw_sql("CREATE TABLE audit_log (customer_id int8, order_id int8 UNIQUE, points int8)")
        .execute(&env.pool)
        .await
        .expect("audit table");
    let stream = TestStream::new(&env.queue).await;
    if narrow {
        stream
            .context
            .create_stream(async_nats::jetstream::stream::Config {
                name: stream.dead_letter_stream.clone(),
                subjects: vec![format!("{}.loyalty", stream.dead_letter_stream)],
                ..Default::default()
            })
            .await
            .expect("the dead-letter stream an older idem created");
    }
    let host = env.start_host(parse(&two_pipelines_text(&env, &stream)));
    for order_id in 0..40 {
        stream
            .publish(&order(order_id, order_id % 5, 700), None)
            .await;
        if order_id % 13 == 0 {
            stream.publish(b"not json", None).await;
        }
    }
    // Orders 0, 13, 26 and 39 are each followed by a malformed message.
    wait_for("eight dead letters", Duration::from_secs(60), || async {
        stream.dead_letters().await.len() == 8
    })
    .await;
    wait_drained_by(&stream, "idem-loyalty").await;
    wait_drained_by(&stream, "idem-audit").await;
    assert!(!host.is_finished(), "the host stopped");
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 40);
    assert_eq!(env.count("SELECT count(*) FROM audit_log").await, 40);
    let letters = stream.dead_letters().await;
    for pipeline in ["loyalty", "audit"] {
        let theirs = letters
            .iter()
            .filter(|(_, headers)| {
                headers
                    .iter()
                    .any(|(key, value)| key == "x-idem-pipeline" && value == pipeline)
            })
            .count();
        assert_eq!(theirs, 4, "{pipeline}'s dead letters: {letters:?}");
    }
    let info = stream
        .context
        .get_stream(&stream.dead_letter_stream)
        .await
        .expect("dead-letter stream")
        .info()
        .await
        .expect("info")
        .config
        .subjects
        .clone();
    assert!(
        info.iter()
            .any(|subject| subject.ends_with(".audit") || subject.ends_with(".>")),
        "{info:?}"
    );
    stream.cleanup().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pipelines_on_one_stream_each_keep_their_dead_letters() {
    two_pipelines_dead_letter_on_a_shared_stream("js_shared", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_narrow_dead_letter_stream_is_extended_for_a_second_pipeline() {
    two_pipelines_dead_letter_on_a_shared_stream("js_narrow", true).await;
}

/// The issue's doubling: orders consumed, their claims gone with retention (a 3 s window
/// here), then the durable consumer deleted by an operator. The consumer idem creates again
/// starts at the window's start: the old orders are not applied again (the ledger's unique
/// order id would dead-letter them), and the new ones are credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_created_again_starts_within_the_claim_window() {
    let env = TestEnv::new("js_window").await;
    let stream = TestStream::new(&env.queue).await;
    let retention = "[pipelines.loyalty.retention]\nwindow = \"3s\"";
    let host = env.start_host(config(&env, &stream, "", retention));
    for order_id in 0..50 {
        stream
            .publish(&order(order_id, order_id % 7, 300), None)
            .await;
    }
    wait_for(
        "the first orders credited",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 50 },
    )
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    tokio::time::sleep(Duration::from_secs(4)).await;
    // What the retention pass does to claims older than the window.
    sqlx::query("DELETE FROM processed_messages WHERE processed_at < now() - interval '3 seconds'")
        .execute(&env.pool)
        .await
        .expect("claims past the window removed");
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        0
    );
    stream.delete_consumer("idem-loyalty").await;
    let host = env.start_host(config(&env, &stream, "", retention));
    wait_for(
        "the consumer created again",
        Duration::from_secs(60),
        || async { stream.consumer_counts("idem-loyalty").await.is_some() },
    )
    .await;
    for order_id in 50..60 {
        stream
            .publish(&order(order_id, order_id % 7, 300), None)
            .await;
    }
    wait_for(
        "the new orders credited",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 60 },
    )
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    assert!(
        stream.dead_letters().await.is_empty(),
        "old orders were delivered again"
    );
    assert_eq!(
        env.count("SELECT coalesce(sum(points), 0)::int8 FROM balances")
            .await,
        60 * 3,
        "balances credited twice"
    );
    stream.cleanup().await;
    env.cleanup().await;
}

/// Deliveries the plugin never saw (here two taken and given back by another reader of the
/// durable consumer; in production restarts, crashes and late acks) do not count as tries:
/// the plugin gets its tries from 1. And when the server's `max_deliver` runs out first, the
/// message is dead-lettered on its last delivery, saying so, instead of being abandoned by
/// the server, neither applied nor dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tries_are_the_plugins_and_the_last_delivery_is_dead_lettered() {
    use async_nats::jetstream::AckKind;
    use async_nats::jetstream::consumer::PullConsumer;
    let env = TestEnv::new("js_tries").await;
    let stream = TestStream::new(&env.queue).await;
    let text = config_text(
        &env,
        &stream,
        "chaos",
        ", max_deliver = 4",
        "max_attempts = 3",
    );
    // The host creates the durable consumer, then stops.
    let host = env.start_host(parse(&text));
    wait_for("the consumer created", Duration::from_secs(60), || async {
        stream.consumer_counts("idem-loyalty").await.is_some()
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    let consumer: PullConsumer = stream
        .context
        .get_consumer_from_stream("idem-loyalty", &stream.name)
        .await
        .expect("the durable consumer");
    // A pull request the stopped host left on a busy server would take the message unseen
    // (a delivery nobody settles until ack_wait): publish once none waits.
    wait_for(
        "the host's pull requests gone",
        Duration::from_secs(30),
        || {
            let mut consumer = consumer.clone();
            async move {
                consumer
                    .info()
                    .await
                    .is_ok_and(|info| info.num_waiting == 0)
            }
        },
    )
    .await;
    stream
        .publish(br#"{"action": "retry"}"#, Some("retry-1"))
        .await;
    for _ in 0..2 {
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(5))
            .messages()
            .await
            .expect("fetch");
        let message = futures::StreamExt::next(&mut batch)
            .await
            .expect("a delivery")
            .expect("a message");
        message
            .ack_with(AckKind::Nak(None))
            .await
            .expect("given back");
    }
    let host = env.start_host(parse(&text));
    wait_for("the dead letter", Duration::from_secs(60), || async {
        stream.dead_letters().await.len() == 1
    })
    .await;
    wait_drained(&stream).await;
    host.stop().await.expect("host stops cleanly");
    let letters = stream.dead_letters().await;
    let (_, headers) = &letters[0];
    let value = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
            .unwrap_or_default()
    };
    assert_eq!(value("x-idem-error-kind"), "retries-exhausted");
    let reason = value("x-idem-reason");
    // Deliveries 3 and 4 were the plugin's tries 1 and 2; it asked for a third.
    assert!(reason.contains("asked for try 3"), "{reason}");
    assert!(reason.contains("delivery 4 of the 4"), "{reason}");
    stream.cleanup().await;
    env.cleanup().await;
}
