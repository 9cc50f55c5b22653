//! JetStream's delivery limits never abandon a message: an operator's consumer
//! (`declare = false`) is served with its own `max_deliver` and `ack_wait`, a dead letter that
//! cannot be stored on a message's last delivery is kept and tried again rather than given
//! back (where it would be abandoned), and a message on its last delivery that was pulled but
//! not started when the host stopped is dead-lettered rather than left undelivered.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::stream;

use idem_e2e::jetstream::{TestStream, nats_url};
use idem_e2e::proxy::Proxy;
use idem_e2e::{TestEnv, order, wait_for};

use crate::jetstream::{config_text, parse};

fn write(env: &TestEnv, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, text).expect("write config");
    path
}

/// An operator's consumer that allows no more deliveries than `max_attempts`: `idem run` and
/// `idem check` refuse it, naming the setting, instead of running into abandoned messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_consumer_with_too_few_deliveries_is_refused() {
    let env = TestEnv::new("js_operator_limit").await;
    let stream = TestStream::new(&env.queue).await;
    stream
        .operator_consumer("idem-loyalty", 3, Duration::from_secs(30))
        .await;
    let text = config_text(
        &env,
        &stream,
        "loyalty",
        ", declare = false",
        "max_attempts = 5",
    );
    let path = write(&env, &text);
    idem_e2e::run_and_check_refuse(&path, "max_deliver", "an operator's max_deliver of 3");
    stream.cleanup().await;
    env.cleanup().await;
}

/// An operator's consumer with `ack_wait` 1 s (the config's default is 30 s) and a transaction
/// of 3 s: the host marks the message in progress at the consumer's pace, so it is delivered
/// once (at the config's pace it would be delivered again mid-flight, a duplicate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_consumer_is_kept_in_progress_at_its_own_ack_wait() {
    let env = TestEnv::new("js_operator_ack_wait").await;
    env.slow_ledger("true", 3.0).await;
    let stream = TestStream::new(&env.queue).await;
    stream
        .operator_consumer("idem-loyalty", -1, Duration::from_secs(1))
        .await;
    let text = config_text(
        &env,
        &stream,
        "loyalty",
        ", declare = false, in_progress = true",
        "",
    );
    let metrics = Arc::new(idem_host::telemetry::metrics::Metrics::new());
    let host = env.start_host_with_metrics(parse(&text), Arc::clone(&metrics));
    stream.publish(&order(7, 1, 700), None).await;
    wait_for("the order credited", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1
    })
    .await;
    wait_for("the delivery settled", Duration::from_secs(30), || async {
        metrics.messages("loyalty", "applied") == 1
    })
    .await;
    // Long enough for a redelivery to arrive and settle.
    tokio::time::sleep(Duration::from_secs(3)).await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(
        metrics.messages("loyalty", "duplicate"),
        0,
        "delivered again while in progress"
    );
    stream.cleanup().await;
    env.cleanup().await;
}

/// A poison message whose dead letter cannot be stored (the dead-letter stream is full, with
/// `discard = new`) on its last delivery (`max_deliver = 2`): the host keeps it and tries
/// the store again, and once there is room the dead letter is stored. Given back instead, the
/// server would never deliver it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_cannot_be_stored_on_the_last_delivery_is_kept() {
    let env = TestEnv::new("js_full_dead_letters").await;
    let stream = TestStream::new(&env.queue).await;
    let full = stream::Config {
        name: stream.dead_letter_stream.clone(),
        subjects: vec![stream.dead_letter_subject.clone()],
        max_messages: 1,
        discard: stream::DiscardPolicy::New,
        ..stream::Config::default()
    };
    stream
        .context
        .create_stream(full.clone())
        .await
        .expect("the dead-letter stream");
    stream
        .context
        .publish(
            stream.dead_letter_subject.clone(),
            "an earlier dead letter".into(),
        )
        .await
        .expect("publish")
        .await
        .expect("stored");
    let text = config_text(
        &env,
        &stream,
        "loyalty",
        ", max_deliver = 2",
        "max_attempts = 1",
    );
    let host = env.start_host(parse(&text));
    stream.publish(b"not json at all", Some("poison")).await;
    // Both deliveries spent, the second held while the store fails.
    wait_for("the last delivery", Duration::from_secs(60), || async {
        let found: Result<PullConsumer, _> = stream
            .context
            .get_consumer_from_stream("idem-loyalty", &stream.name)
            .await;
        let Ok(mut consumer) = found else {
            return false;
        };
        consumer
            .info()
            .await
            .is_ok_and(|info| info.delivered.stream_sequence >= 1 && info.num_redelivered >= 1)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut room = stream
        .context
        .get_stream(&stream.dead_letter_stream)
        .await
        .expect("the dead-letter stream")
        .cached_info()
        .config
        .clone();
    room.max_messages = 100;
    stream
        .context
        .update_stream(room)
        .await
        .expect("room in the dead-letter stream");
    wait_for(
        "the dead letter stored",
        Duration::from_secs(60),
        || async { stream.dead_letters().await.len() == 2 },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    stream.cleanup().await;
    env.cleanup().await;
}

/// A message on its last delivery, pulled but not started when the host stops (the one
/// worker busy with a slow message ahead of it): dead-lettered, not left undelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_delivery_not_started_at_a_stop_is_dead_lettered() {
    let env = TestEnv::new("js_unstarted_last").await;
    env.slow_ledger("NEW.order_id = 1", 4.0).await;
    let stream = TestStream::new(&env.queue).await;
    let text = config_text(
        &env,
        &stream,
        "loyalty",
        ", max_deliver = 2, ack_wait = \"1s\"",
        "max_attempts = 1",
    )
    .replace("workers = 8", "workers = 1");
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
    wait_for("no pull request waiting", Duration::from_secs(30), || {
        let mut consumer = consumer.clone();
        async move {
            consumer
                .info()
                .await
                .is_ok_and(|info| info.num_waiting == 0)
        }
    })
    .await;
    stream.publish(&order(1, 1, 100), Some("slow")).await;
    stream.publish(&order(2, 1, 100), Some("behind")).await;
    // Their first deliveries, taken and never settled (a host that crashed).
    let mut batch = consumer
        .fetch()
        .max_messages(2)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("fetch");
    for _ in 0..2 {
        futures::StreamExt::next(&mut batch)
            .await
            .expect("a delivery")
            .expect("a message");
    }
    drop(batch);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Delivered again, for the last time: order 1 takes the one worker for 4 s, order 2
    // waits behind it, and the host stops meanwhile.
    let host = env.start_host(parse(&text));
    wait_for(
        "the slow order started",
        Duration::from_secs(30),
        || async {
            env.count(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query LIKE '%point_ledger%' AND wait_event = 'PgSleep'",
            )
            .await
                >= 1
        },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    let credited = env
        .count("SELECT count(*) FROM point_ledger WHERE order_id = 2")
        .await;
    let letters = stream.dead_letters().await;
    assert!(
        credited == 1 || letters.len() == 1,
        "order 2 was neither applied nor dead-lettered: abandoned"
    );
    if credited == 0 {
        let (body, headers) = &letters[0];
        assert_eq!(body, &order(2, 1, 100));
        assert!(
            headers
                .iter()
                .any(|(name, value)| name == "x-idem-error-kind" && value == "deliveries-exhausted"),
            "{headers:?}"
        );
    }
    stream.cleanup().await;
    env.cleanup().await;
}

/// A host stops in bounded time while its pull holds hundreds of messages and the server is
/// slow to confirm (every answer 100 ms late, through a proxy): what it gives back goes out
/// at once, and what it cannot give back within its bound the server delivers again after
/// `ack_wait`. One at a time, the give-back of a full pull took minutes, past any drain
/// timeout. Every order is applied once in the end, by a second host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_holding_a_full_pull_stops_in_time_against_a_slow_server() {
    let env = TestEnv::new("js_slow_give_back").await;
    // One message at a time, each 20 ms: the pull stays full.
    env.slow_ledger("true", 0.02).await;
    let stream = TestStream::new(&env.queue).await;
    for order_id in 1..=1_200 {
        stream
            .publish(&order(order_id, order_id % 20, 100), None)
            .await;
    }
    let server: std::net::SocketAddr = nats_url()
        .trim_start_matches("nats://")
        .parse()
        .expect("the NATS address");
    let proxy = Proxy::start(server).await;
    let one_at_a_time = "[pipelines.loyalty.batch]\nsize = 1";
    let text = config_text(
        &env,
        &stream,
        "loyalty",
        ", ack_wait = \"5s\"",
        one_at_a_time,
    )
    .replace("workers = 8", "workers = 1")
    .replace("prefetch = 64", "prefetch = 1000")
    .replace(&nats_url(), &format!("nats://127.0.0.1:{}", proxy.port));
    let host = env.start_host(parse(&text));
    wait_for("orders applied", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await >= 20
    })
    .await;
    proxy.delay_answers(Duration::from_millis(100));
    let started = std::time::Instant::now();
    let stopped = tokio::time::timeout(Duration::from_secs(25), host.stop()).await;
    assert!(
        stopped.is_ok(),
        "the host did not stop within 25 s of being asked"
    );
    eprintln!("stopped in {:?}", started.elapsed());
    let applied = env.count("SELECT count(*) FROM point_ledger").await;
    assert!(
        applied < 1_200,
        "every order was applied before the stop: nothing was tested"
    );
    let text = config_text(&env, &stream, "loyalty", ", ack_wait = \"5s\"", "");
    let host = env.start_host(parse(&text));
    wait_for("every order applied", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1_200
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    env.assert_loyalty_consistent().await;
    drop(proxy);
    stream.cleanup().await;
    env.cleanup().await;
}
