//! Batched transactions: several messages per transaction, each in its own savepoint.
//! A bad message rolls back alone, in-batch duplicates apply once, and two hosts with
//! overlapping keys never deadlock on claims.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use idem_e2e::{TestEnv, order, wait_for};
use idem_host::message::InboundMessage;
use idem_host::pipeline::process::{Disposition, Settled, handle_batch};
use idem_host::telemetry::metrics::Metrics;

fn batch_of(orders: &[(i64, i64, i64)]) -> Vec<(InboundMessage, u32)> {
    orders
        .iter()
        .map(|(order_id, customer_id, total_cents)| {
            (
                InboundMessage {
                    pipeline: "loyalty".into(),
                    body: order(*order_id, *customer_id, *total_cents),
                    ..InboundMessage::default()
                },
                1,
            )
        })
        .collect()
}

/// The batch as `handle_batch` takes it: the deliveries are borrowed, not copied.
fn borrowed(batch: &[(InboundMessage, u32)]) -> Vec<(&InboundMessage, u32)> {
    batch
        .iter()
        .map(|(message, attempt)| (message, *attempt))
        .collect()
}

/// Customer 13's credit divides by zero: an SQL error in the middle of a batch.
const FAILS_FOR_CUSTOMER_13: &str = r#"
[pipelines.loyalty.batch]
size = 16
"#;

#[tokio::test]
async fn a_failing_message_rolls_back_to_its_savepoint_and_the_rest_commit() {
    let env = TestEnv::new("batch_savepoint").await;
    let text = env.config_text("loyalty", FAILS_FOR_CUSTOMER_13).replace(
        "VALUES ($1, $2)\nON CONFLICT (customer_id)",
        "VALUES ($1, $2 + 0 * (1 / ($1::int8 - 13)))\nON CONFLICT (customer_id)",
    );
    let config = idem_host::config::Config::from_toml(std::path::Path::new("/tmp/b.toml"), &text)
        .expect("config");
    let pipeline = idem_host::pipeline::Pipeline::start(
        config.pipelines[0].clone(),
        idem_host::sandbox::PluginRuntime::new().expect("runtime"),
        &env.open_database().await,
        Arc::new(Metrics::new()),
        idem_host::relay::RelayWaker::default(),
    )
    .await
    .expect("pipeline starts");
    let batch = batch_of(&[
        (1, 14, 100),
        (2, 14, 100),
        (3, 13, 100),
        (4, 15, 100),
        (5, 14, 100),
    ]);

    let dispositions = handle_batch(&pipeline, &borrowed(&batch), &CancellationToken::new()).await;

    for (index, disposition) in dispositions.iter().enumerate() {
        if index == 2 {
            let Disposition::DeadLetter { error_kind, reason } = disposition else {
                panic!("order 3 should be rejected, got {disposition:?}");
            };
            assert_eq!(*error_kind, "sql");
            assert!(reason.contains("division by zero"), "{reason}");
        } else {
            assert_eq!(
                *disposition,
                Disposition::Ack(Settled::Applied),
                "order {}",
                index + 1
            );
        }
    }
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 4);
    assert_eq!(
        env.count(
            "SELECT count(*) FROM processed_messages WHERE message_key = 'order-completed:3'"
        )
        .await,
        0,
        "the failed message's claim rolled back with its savepoint"
    );
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

#[tokio::test]
async fn duplicates_inside_one_batch_apply_once() {
    let env = TestEnv::new("batch_duplicates").await;
    let pipeline = env
        .pipeline("loyalty", "[pipelines.loyalty.batch]\nsize = 16")
        .await;
    let batch = batch_of(&[
        (7, 1, 500),
        (8, 2, 500),
        (7, 1, 500),
        (7, 1, 500),
        (9, 3, 500),
    ]);

    let dispositions = handle_batch(&pipeline, &borrowed(&batch), &CancellationToken::new()).await;

    let applied = Disposition::Ack(Settled::Applied);
    let duplicate = Disposition::Ack(Settled::Duplicate);
    assert_eq!(
        dispositions,
        vec![
            applied.clone(),
            applied.clone(),
            duplicate.clone(),
            duplicate,
            applied
        ]
    );
    // A repeat of the whole batch is all duplicates.
    let again = handle_batch(&pipeline, &borrowed(&batch), &CancellationToken::new()).await;
    assert!(
        again
            .iter()
            .all(|d| *d == Disposition::Ack(Settled::Duplicate)),
        "{again:?}"
    );
    assert_eq!(
        env.count("SELECT points FROM balances WHERE customer_id = 1")
            .await,
        5
    );
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_with_overlapping_keys_do_not_deadlock() {
    let env = TestEnv::new("batch_overlap").await;
    // Two pipelines for one consumer, as two hosts would run them: a host applies its own
    // batches one at a time, so only the claims' key order keeps two hosts from deadlocking.
    let pipeline = Arc::new(
        env.pipeline("loyalty", "[pipelines.loyalty.batch]\nsize = 64")
            .await,
    );
    let other_host = Arc::new(
        env.pipeline("loyalty", "[pipelines.loyalty.batch]\nsize = 64")
            .await,
    );
    // The same 60 orders, in opposite orders: unsorted claims would deadlock.
    let forward: Vec<(i64, i64, i64)> = (1..=60).map(|id| (id, id % 7, 1_000)).collect();
    let backward: Vec<(i64, i64, i64)> = forward.iter().rev().copied().collect();
    let mut rounds = Vec::new();
    for round in 0..5 {
        let offset = round * 1_000;
        let shift = |orders: &[(i64, i64, i64)]| -> Vec<(i64, i64, i64)> {
            orders
                .iter()
                .map(|(id, c, t)| (id + offset, *c, *t))
                .collect()
        };
        let first = {
            let pipeline = Arc::clone(&pipeline);
            let batch = batch_of(&shift(&forward));
            tokio::spawn(async move {
                handle_batch(&pipeline, &borrowed(&batch), &CancellationToken::new()).await
            })
        };
        let second = {
            let pipeline = Arc::clone(&other_host);
            let batch = batch_of(&shift(&backward));
            tokio::spawn(async move {
                handle_batch(&pipeline, &borrowed(&batch), &CancellationToken::new()).await
            })
        };
        let mut all = first.await.expect("first worker");
        all.extend(second.await.expect("second worker"));
        rounds.push(all);
    }
    for dispositions in &rounds {
        let applied = dispositions
            .iter()
            .filter(|d| **d == Disposition::Ack(Settled::Applied))
            .count();
        let duplicates = dispositions
            .iter()
            .filter(|d| **d == Disposition::Ack(Settled::Duplicate))
            .count();
        assert_eq!((applied, duplicates), (60, 60), "{dispositions:?}");
    }
    for host in [&pipeline, &other_host] {
        assert_eq!(
            host.metrics().database_retries(host.name(), "40P01"),
            0,
            "a deadlock between the two batches"
        );
    }
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

#[tokio::test]
async fn batched_pipeline_credits_every_order_once_through_the_broker() {
    let env = TestEnv::new("batch_broker").await;
    let metrics = Arc::new(Metrics::new());
    let text = env
        .config_text(
            "loyalty",
            "[pipelines.loyalty.batch]\nsize = 32\nlinger = \"5ms\"",
        )
        .replace("workers = 8", "workers = 2");
    let config = idem_host::config::Config::from_toml(std::path::Path::new("/tmp/b.toml"), &text)
        .expect("config");
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    let orders = 2_000;
    for order_id in 1..=orders {
        env.publish(&order(order_id, order_id % 50, 100 + order_id))
            .await;
        if order_id % 5 == 0 {
            env.publish(&order(order_id, order_id % 50, 100 + order_id))
                .await;
        }
    }
    wait_for("every delivery settled", Duration::from_secs(120), || {
        let metrics = Arc::clone(&metrics);
        async move {
            metrics.messages("loyalty", "applied") + metrics.messages("loyalty", "duplicate")
                == 2_400
        }
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(metrics.messages("loyalty", "applied"), 2_000);
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, orders);
    assert_eq!(env.ready(&env.queue).await, 0);
    assert_eq!(idem_e2e::unacked(&env.queue), 0);
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

/// `batch.latency`: under a backlog the batch size grows from 1 while batches settle well
/// within the target, never past `batch.size`; when each message costs 4 ms of the
/// database's time it stays where a batch still settles within the target. Every order is
/// credited once either way.
#[tokio::test]
async fn an_adaptive_batch_size_follows_what_a_batch_costs_and_credits_once() {
    let quick = adaptive_batches("batch_adaptive_quick", 1_500, "0").await;
    assert!(quick > 8, "the batch size never grew past {quick}");
    assert!(quick <= 48, "the batch size went past batch.size: {quick}");
    let slow = adaptive_batches("batch_adaptive_slow", 300, "0.004").await;
    assert!(
        (2..=24).contains(&slow),
        "4 ms a message against a 100 ms target: the size reached {slow}"
    );
}

/// Runs `orders` orders already queued through a pipeline of batches up to 48 adapting to
/// 100 ms, each ledger row taking `sleep` seconds; returns the largest batch size seen.
async fn adaptive_batches(name: &str, orders: i64, sleep: &str) -> i64 {
    let env = TestEnv::new(name).await;
    for order_id in 1..=orders {
        env.publish(&order(order_id, order_id % 50, 100 + order_id))
            .await;
    }
    let metrics = Arc::new(Metrics::new());
    let text = env
        .config_text(
            "loyalty",
            "[pipelines.loyalty.batch]\nsize = 48\nlatency = \"100ms\"",
        )
        .replace("workers = 8", "workers = 2")
        .replace(
            "VALUES ($1, $2, $3)",
            &format!("SELECT $1, $2, $3 FROM pg_sleep({sleep})"),
        );
    let config = idem_host::config::Config::from_toml(std::path::Path::new("/tmp/a.toml"), &text)
        .expect("config");
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    let mut largest = 0;
    let started = std::time::Instant::now();
    while metrics.messages("loyalty", "applied") < orders as u64 {
        largest = largest.max(metrics.batch_size_now("loyalty"));
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{} of {orders} applied in 120 s",
            metrics.messages("loyalty", "applied")
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, orders);
    assert_eq!(env.ready(&env.queue).await, 0);
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
    largest
}

/// A plugin returns a key with a NUL character (PostgreSQL refuses `\0` in text) for one
/// message among 600 good ones in one batch: exactly that message is dead-lettered as
/// `invalid-output`, before any SQL, and the rest apply; nothing loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_key_in_a_batch_dead_letters_only_its_message() {
    let env = TestEnv::new("batch_nul_key").await;
    let credit = |order_id: i64| {
        serde_json::json!({
            "key": format!("order:{order_id}"),
            "effects": [
                {"statement": "record_ledger", "params": [order_id % 7, order_id, 10]},
                {"statement": "credit_balance", "params": [order_id % 7, 10]},
            ],
        })
    };
    for order_id in 1..=600 {
        if order_id == 300 {
            let mut bad = credit(0);
            bad["key"] = serde_json::json!("order:\u{0}300");
            env.publish(bad.to_string().as_bytes()).await;
        }
        env.publish(credit(order_id).to_string().as_bytes()).await;
    }
    let host = env.start_host(env.config("chaos", "[pipelines.loyalty.batch]\nsize = 700"));
    wait_for(
        "600 credits and one dead letter",
        Duration::from_secs(30),
        || async {
            env.count("SELECT count(*) FROM point_ledger").await == 600
                && env.ready(&env.dead_letter_queue).await == 1
        },
    )
    .await;
    host.stop().await.expect("host stops");
    let dead = env.drain(&env.dead_letter_queue).await;
    assert_eq!(dead.len(), 1);
    let header = |name: &str| {
        dead[0]
            .1
            .iter()
            .find(|(header, _)| header == name)
            .map(|(_, value)| value.clone())
            .unwrap_or_default()
    };
    assert_eq!(header("x-idem-error-kind"), "invalid-output");
    assert!(header("x-idem-reason").contains("NUL"), "{dead:?}");
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        600
    );
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}
