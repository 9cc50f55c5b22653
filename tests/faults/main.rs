//! The fault-injection suite: crashes, restarts and broken connections, each followed by a
//! total-queue check. Every published message must end applied once, as a duplicate, or in
//! the dead-letter queue with a reason: lost, unexpected and doubled are all 0.
//!
//! Scenarios restart PostgreSQL and RabbitMQ and close broker connections, so they run one at
//! a time (a process-wide lock) and in their own test binary, after the other tests.
//! `IDEM_FAULTS=full` runs the full sizes (10,000 messages, 5 kills, 30 s of backend
//! terminations); the default short profile keeps CI fast. `scripts/faults.sh` runs it.

mod cluster;
mod database;
mod failover;
mod jetstream;
mod memory_alarm;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::Mutex;

use idem_e2e::proxy::Proxy;
use idem_e2e::{IdemProcess, TestEnv, order, spawn_idem, unacked, wait_for};
use idem_host::telemetry::metrics::Metrics;

/// One scenario at a time: they restart shared services.
static SERIAL: Mutex<()> = Mutex::const_new(());

fn full() -> bool {
    std::env::var("IDEM_FAULTS").is_ok_and(|profile| profile == "full")
}

/// `short` in the default profile, `long` with `IDEM_FAULTS=full`.
fn sized(short: u64, long: u64) -> u64 {
    if full() { long } else { short }
}

/// What a scenario published: the distinct orders and how many deliveries in all.
#[derive(Default)]
struct Published {
    orders: BTreeSet<i64>,
    deliveries: u64,
    bad: u64,
}

fn customer(order_id: i64) -> i64 {
    order_id % 37
}

fn total(order_id: i64) -> i64 {
    100 + (order_id * 53) % 20_000
}

/// Publishes `orders` distinct orders plus `duplicates` (a fraction) redeliveries of random
/// ones, shuffled, from its own connection.
async fn publish_orders(queue: String, first: i64, orders: i64, duplicates: f64) -> Published {
    use rand::seq::SliceRandom;
    let ids = {
        let mut ids: Vec<i64> = (first..first + orders).collect();
        let mut rng = rand::rng();
        let extra = (orders as f64 * duplicates).round() as i64;
        for _ in 0..extra {
            ids.push(rng.random_range(first..first + orders));
        }
        ids.shuffle(&mut rng);
        ids
    };
    let (_connection, channel) = idem_e2e::connect_channel().await;
    let mut published = Published::default();
    for id in ids {
        idem_e2e::publish(&channel, &queue, &order(id, customer(id), total(id))).await;
        published.orders.insert(id);
        published.deliveries += 1;
    }
    published
}

/// The total-queue check. `bad` messages must be in the dead-letter queue with a reason.
async fn check(env: &TestEnv, scenario: &str, published: &Published, faults: u64) {
    let expected = published.orders.len() as i64;
    let claims = env
        .count("SELECT count(*) FROM processed_messages WHERE consumer = 'loyalty'")
        .await;
    let ledger_rows = env.count("SELECT count(*) FROM point_ledger").await;
    let distinct = env
        .count("SELECT count(DISTINCT order_id) FROM point_ledger")
        .await;
    let unexpected = {
        let ids: Vec<i64> = sqlx::query_scalar("SELECT order_id FROM point_ledger")
            .fetch_all(&env.pool)
            .await
            .expect("ledger");
        ids.iter()
            .filter(|id| !published.orders.contains(id))
            .count()
    };
    let lost = expected - distinct;
    let doubled = ledger_rows - distinct;
    let dead = env.drain(&env.dead_letter_queue).await;
    let without_reason = dead
        .iter()
        .filter(|(_, headers)| !headers.iter().any(|(name, _)| name == "x-idem-reason"))
        .count();
    eprintln!(
        "faults: {scenario}: {} deliveries of {expected} orders, {} bad, {faults} faults injected: \
         lost {lost}, doubled {doubled}, unexpected {unexpected}, dead-lettered {}",
        published.deliveries,
        published.bad,
        dead.len()
    );
    assert_eq!(lost, 0, "{scenario}: orders lost");
    assert_eq!(doubled, 0, "{scenario}: orders credited twice");
    assert_eq!(
        unexpected, 0,
        "{scenario}: credits for orders never published"
    );
    assert_eq!(claims, expected, "{scenario}: claims differ from orders");
    assert_eq!(dead.len() as u64, published.bad, "{scenario}: dead letters");
    assert_eq!(
        without_reason, 0,
        "{scenario}: a dead letter without its reason"
    );
    assert_eq!(
        env.ready(&env.queue).await,
        0,
        "{scenario}: messages left in the queue"
    );
    assert_eq!(unacked(&env.queue), 0, "{scenario}: messages left unacked");
    env.assert_loyalty_consistent().await;
}

/// Waits until every published order has its ledger row and the queue is empty.
async fn wait_settled(env: &TestEnv, published: &Published, timeout: Duration) {
    let expected = published.orders.len() as i64;
    wait_for("every order credited", timeout, || async {
        env.count("SELECT count(DISTINCT order_id) FROM point_ledger")
            .await
            >= expected
    })
    .await;
    wait_for("the queue drained", timeout, || async {
        env.ready(&env.queue).await == 0 && unacked(&env.queue) == 0
    })
    .await;
}

fn write_config(env: &TestEnv, amqp_query: &str) -> PathBuf {
    let text = env
        .config_text("loyalty", "[pipelines.loyalty.batch]\nsize = 32")
        .replace("%2f\"", &format!("%2f{amqp_query}\""));
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, text).expect("write config");
    path
}

/// The loyalty config with the database reached through `proxy`, in plain text
/// (`sslmode=disable`) so the proxy can read the protocol (it looks for `COMMIT`).
fn config_via_proxy(env: &TestEnv, proxy: &Proxy) -> idem_host::config::Config {
    let proxied = env
        .database_url
        .replace("127.0.0.1:5432", &format!("127.0.0.1:{}", proxy.port));
    let separator = if proxied.contains('?') { '&' } else { '?' };
    let via_proxy = format!("{proxied}{separator}sslmode=disable");
    let text = env.config_text_at(&via_proxy, "loyalty", "");
    idem_host::config::Config::from_toml(std::path::Path::new("/tmp/via-proxy.toml"), &text)
        .expect("config")
}

fn signal(process: &IdemProcess, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &process.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {signal}");
}

/// SIGTERM, then wait for a clean exit.
fn stop(process: IdemProcess) {
    let status = process.terminate();
    assert!(status.success(), "idem exited with {status}");
}

fn kill9(mut process: IdemProcess) {
    let _ = process.kill();
    let _ = process.wait();
}

/// Restarts the broker's application (as an upgrade would); its durable queues stay.
fn restart_rabbitmq() {
    let restarted = Command::new("rabbitmqctl")
        .arg("stop_app")
        .status()
        .and_then(|_| Command::new("rabbitmqctl").arg("start_app").status())
        .expect("rabbitmqctl");
    assert!(restarted.success(), "broker restart");
}

async fn random_pause(low_ms: u64, high_ms: u64) {
    let pause = { rand::rng().random_range(low_ms..high_ms) };
    tokio::time::sleep(Duration::from_millis(pause)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_run_loses_and_doubles_nothing() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_kill9").await;
    let config = write_config(&env, "");
    let orders = sized(2_000, 10_000) as i64;
    let kills = sized(3, 5);
    let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.2));
    let mut host = spawn_idem(&config, &[]);
    for _ in 0..kills {
        random_pause(300, 1_500).await;
        kill9(host);
        host = spawn_idem(&config, &[]);
    }
    let published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    stop(host);
    check(&env, "kill -9", &published, kills).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_one_killed_repeatedly() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_two_hosts").await;
    let config = write_config(&env, "");
    let orders = sized(2_000, 10_000) as i64;
    let kills = sized(4, 10);
    let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.2));
    let steady = spawn_idem(&config, &[]);
    let mut victim = spawn_idem(&config, &[]);
    for _ in 0..kills {
        random_pause(200, 1_000).await;
        kill9(victim);
        victim = spawn_idem(&config, &[]);
    }
    let published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    stop(victim);
    stop(steady);
    check(&env, "two hosts, one killed", &published, kills).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_points_before_commit_after_commit_and_after_ack() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_crash_points").await;
    let config = write_config(&env, "");
    let mut published = Published::default();
    let mut order_id = 0;
    for failpoint in ["before-commit", "after-commit", "after-ack"] {
        order_id += 1;
        let mut host = spawn_idem(&config, &[("IDEM_FAILPOINT", failpoint)]);
        env.publish(&order(order_id, customer(order_id), total(order_id)))
            .await;
        published.orders.insert(order_id);
        published.deliveries += 1;
        let started = Instant::now();
        while host.try_wait().expect("wait idem").is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "idem did not reach {failpoint}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Restarted without the failpoint: the message is applied once, whatever the crash.
        let host = spawn_idem(&config, &[]);
        wait_settled(&env, &published, Duration::from_secs(60)).await;
        stop(host);
    }
    check(&env, "crash points", &published, 3).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_outcome_unknown_is_retried_not_dead_lettered() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_commit_unknown").await;
    let proxy = Proxy::start("127.0.0.1:5432".parse().expect("address")).await;
    let config = config_via_proxy(&env, &proxy);
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    wait_for("the host to consume", Duration::from_secs(30), || async {
        idem_e2e::consumers(&env.queue) > 0
    })
    .await;
    let mut published = Published::default();
    let rounds = sized(3, 10) as i64;
    for order_id in 1..=rounds {
        proxy.drop_next_commit();
        env.publish(&order(order_id, customer(order_id), total(order_id)))
            .await;
        published.orders.insert(order_id);
        published.deliveries += 1;
        wait_settled(&env, &published, Duration::from_secs(60)).await;
    }
    assert_eq!(
        proxy.commits_dropped(),
        rounds as u64,
        "each COMMIT lost its answer"
    );
    assert!(
        metrics.database_retries("loyalty", "connection") >= rounds as u64,
        "the lost COMMITs were retried"
    );
    host.stop().await.expect("host stops cleanly");
    check(&env, "COMMIT outcome unknown", &published, rounds as u64).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_backends_terminated_every_200ms() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_terminate").await;
    let config = write_config(&env, "");
    let host = spawn_idem(&config, &[]);
    let orders = sized(2_000, 10_000) as i64;
    let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.2));
    let admin = sqlx::PgPool::connect(&idem_e2e::admin_url())
        .await
        .expect("admin pool");
    let storm = Duration::from_secs(sized(5, 30));
    let started = Instant::now();
    let mut terminated = 0u64;
    while started.elapsed() < storm {
        let killed: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = 'idem'",
        )
        .bind(&env.database)
        .fetch_all(&admin)
        .await
        .expect("terminate backends");
        terminated += killed.len() as u64;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    let idle_in_transaction: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(&env.database)
    .fetch_one(&admin)
    .await
    .expect("pg_stat_activity");
    assert_eq!(idle_in_transaction, 0, "a session left idle in transaction");
    stop(host);
    assert!(
        terminated > 0,
        "no backend was terminated; nothing was tested"
    );
    check(&env, "backends terminated", &published, terminated).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_fast_and_immediate_restarts() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_pg_restart").await;
    let config = write_config(&env, "");
    let host = spawn_idem(&config, &[]);
    let orders = sized(2_000, 10_000) as i64;
    let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.2));
    for mode in ["fast", "immediate"] {
        random_pause(500, 1_500).await;
        assert!(
            idem_e2e::restart_postgres(mode),
            "PostgreSQL restart ({mode})"
        );
    }
    let published = publisher.await.expect("publisher");
    // The test's own pool lost its connections too; sqlx reconnects on next use.
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    stop(host);
    check(&env, "PostgreSQL restarts", &published, 2).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_connections_closed_and_broker_restarted() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_rabbit").await;
    let config = write_config(&env, "");
    let host = spawn_idem(&config, &[]);
    let orders = sized(2_000, 10_000) as i64;
    let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.2));
    let closes = sized(3, 5);
    let mut closed = 0;
    for _ in 0..closes {
        random_pause(300, 1_000).await;
        closed += idem_e2e::close_connections_named(&env.queue);
    }
    let mut published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    assert!(closed >= closes, "closed {closed} connections");

    // The broker restarts (its application, as an upgrade would): the host reconnects and
    // resumes by itself, and later messages are applied.
    restart_rabbitmq();
    let more = publish_orders(env.queue.clone(), orders + 1, 200, 0.2).await;
    published.orders.extend(more.orders);
    published.deliveries += more.deliveries;
    wait_settled(&env, &published, Duration::from_secs(120)).await;

    // A consumer the broker cancels (its queue deleted and declared again) is re-subscribed.
    env.channel_queue_delete(&env.queue).await;
    let more = publish_orders(env.queue.clone(), orders + 1_000, 100, 0.0).await;
    published.orders.extend(more.orders);
    published.deliveries += more.deliveries;
    wait_settled(&env, &published, Duration::from_secs(120)).await;
    stop(host);
    check(&env, "RabbitMQ faults", &published, closed + 2).await;
    env.cleanup().await;
}

/// A retry waiting in its delay queue when the broker restarts is kept (a durable quorum
/// queue) and comes back for its next try after the restart: with `max_attempts = 2` that
/// try dead-letters it, carrying attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_waiting_in_its_delay_queue_survives_a_broker_restart() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_retry_restart").await;
    let text = env.config_text(
        "chaos",
        "max_attempts = 2\n\n[pipelines.loyalty.retry]\ninitial = \"10s\"\njitter = 0.0\n",
    );
    let config = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&config, text).expect("write config");
    let host = spawn_idem(&config, &[]);
    // 10 s lands on the grid's 10,842 ms step (100 ms × 1.25^21).
    let delay_queue = format!("{}.idem-delay.10842ms", env.queue);
    env.publish(br#"{"action": "retry"}"#).await;
    wait_for(
        "the retry in its delay queue",
        Duration::from_secs(30),
        || async { idem_e2e::queue_waiting(&delay_queue).await == Some(1) },
    )
    .await;
    restart_rabbitmq();
    wait_for(
        "the second try's dead letter",
        Duration::from_secs(90),
        || async { idem_e2e::queue_waiting(&env.dead_letter_queue).await == Some(1) },
    )
    .await;
    stop(host);
    let dead = env.drain(&env.dead_letter_queue).await;
    let attempt = dead[0]
        .1
        .iter()
        .find(|(name, _)| name == "x-idem-attempt")
        .map(|(_, value)| value.clone());
    assert_eq!(attempt.as_deref(), Some("2"), "{dead:?}");
    env.channel_queue_delete(&delay_queue).await;
    let _ = std::fs::remove_file(config);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_host_loses_its_deliveries_to_another() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_sigstop").await;
    // A 2 s heartbeat: a host stopped for 8 s is declared dead by the broker.
    let config = write_config(&env, "?heartbeat=2");
    let paused = spawn_idem(&config, &[]);
    let other = spawn_idem(&config, &[]);
    let orders = sized(2_000, 5_000) as i64;
    let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.2));
    random_pause(300, 800).await;
    signal(&paused, "-STOP");
    tokio::time::sleep(Duration::from_secs(8)).await;
    signal(&paused, "-CONT");
    let published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    assert!(
        matches!(
            std::process::Command::new("kill")
                .args(["-0", &paused.id().to_string()])
                .status()
                .map(|status| status.success()),
            Ok(true)
        ),
        "the paused host crashed"
    );
    stop(paused);
    stop(other);
    check(&env, "SIGSTOP past the heartbeat", &published, 1).await;
    env.cleanup().await;
}

/// A host stopped (SIGSTOP, as in a VM pause) for longer than the plugin deadline while
/// messages are in its plugin: the time it was stopped is not the plugin's, so nothing is
/// dead-lettered as `plugin-deadline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_paused_past_the_plugin_deadline_dead_letters_nothing() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_stop_deadline").await;
    let text = env.config_text("loyalty", "[pipelines.loyalty.limits]\ndeadline_ms = 200");
    let config = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&config, text).expect("write config");
    let host = spawn_idem(&config, &[]);
    let orders = sized(4_000, 10_000) as i64;
    let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.1));
    wait_for("the first credits", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await > 0
    })
    .await;
    let pauses = sized(4, 10);
    for _ in 0..pauses {
        random_pause(50, 300).await;
        signal(&host, "-STOP");
        tokio::time::sleep(Duration::from_secs(2)).await;
        signal(&host, "-CONT");
    }
    let published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    stop(host);
    check(&env, "SIGSTOP past the plugin deadline", &published, pauses).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_at_volume_is_dead_lettered_and_good_input_is_unaffected() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_bad_input").await;
    let config = write_config(&env, "");
    let host = spawn_idem(&config, &[]);
    let orders = sized(2_000, 10_000) as i64;
    let good = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.2));
    let (_connection, channel) = idem_e2e::connect_channel().await;
    let ten_mib = vec![b'7'; 10 * 1024 * 1024];
    let bad_bodies: Vec<Vec<u8>> = vec![
        b"{not json".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x80],
        b"".to_vec(),
        br#"{"order_id": 1}"#.to_vec(),
        br#"{"order_id": "x", "customer_id": 1, "total_cents": 1}"#.to_vec(),
        br#"[1, 2, 3]"#.to_vec(),
        ten_mib,
    ];
    let rounds = sized(20, 100);
    let mut bad = 0;
    for round in 0..rounds {
        for (index, body) in bad_bodies.iter().enumerate() {
            // Two 10 MiB bodies in all, not one per round.
            if index == bad_bodies.len() - 1 && round >= 2 {
                continue;
            }
            idem_e2e::publish(&channel, &env.queue, body).await;
            bad += 1;
        }
    }
    let mut published = good.await.expect("publisher");
    published.bad = bad;
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    wait_for(
        "every bad message dead-lettered",
        Duration::from_secs(60),
        || async { u64::from(env.ready(&env.dead_letter_queue).await) == bad },
    )
    .await;
    let peak = idem_e2e::peak_rss_mib(host.id());
    stop(host);
    eprintln!("faults: bad input: host peak RSS {peak} MiB");
    assert!(peak < 600, "host peak RSS {peak} MiB");
    check(&env, "bad input", &published, bad).await;
    env.cleanup().await;
}

/// The nemesis soak's short profile (`idem_e2e::soak`; `scripts/soak.sh` runs longer ones):
/// two hosts, four pipelines, a minute and a quarter of seeded faults, then the checker.
/// The seed is fixed here so CI meets the same fault schedule each run; `IDEM_SOAK_SEED`
/// picks another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nemesis_soak_short_profile() {
    let _serial = SERIAL.lock().await;
    let seed = std::env::var("IDEM_SOAK_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(26);
    let report = idem_e2e::soak::run(idem_e2e::soak::Profile::short(seed)).await;
    eprintln!("{}", report.text);
    assert!(report.passed, "{}", report.text);
}
