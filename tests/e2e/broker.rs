//! Through the broker: publish, let the host consume, check the database and the queues.

use std::time::Duration;

use std::path::Path;

use idem_e2e::proxy::Proxy;
use idem_e2e::{TestEnv, order, unacked, wait_for};
use idem_host::config::Config;

/// Waits until the pipeline's queue is empty and nothing is held unacked.
async fn wait_drained(env: &TestEnv) {
    wait_for("the queue to drain", Duration::from_secs(60), || async {
        env.ready(&env.queue).await == 0 && unacked(&env.queue) == 0
    })
    .await;
}

/// 2,000 deliveries of 1,600 orders: 200 republished later, 200 published concurrently
/// from a second connection. Every order is credited exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_messages_with_duplicates_apply_once() {
    let env = TestEnv::new("e2e2000").await;
    let host = env.start_host(env.config("loyalty", ""));
    let customer = |order_id: i64| order_id % 50;
    let total = |order_id: i64| 100 + (order_id * 37) % 10_000;

    let concurrent = {
        let queue = env.queue.clone();
        tokio::spawn(async move {
            let (_connection, other) = idem_e2e::connect_channel().await;
            for order_id in 1..=200 {
                idem_e2e::publish(
                    &other,
                    &queue,
                    &order(order_id, customer(order_id), total(order_id)),
                )
                .await;
            }
        })
    };
    for order_id in 1..=1600 {
        env.publish(&order(order_id, customer(order_id), total(order_id)))
            .await;
    }
    concurrent.await.expect("concurrent publisher");
    for order_id in 801..=1000 {
        env.publish(&order(order_id, customer(order_id), total(order_id)))
            .await;
    }

    wait_for("1,600 ledger rows", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1600
    })
    .await;
    wait_drained(&env).await;
    host.stop().await.expect("host stops cleanly");

    assert_eq!(env.ready(&env.queue).await, 0, "messages left in the queue");
    assert_eq!(
        env.ready(&env.dead_letter_queue).await,
        0,
        "messages dead-lettered"
    );
    env.assert_loyalty_consistent().await;
    let expected_points: i64 = (1..=1600).map(|order_id| total(order_id) / 100).sum();
    assert_eq!(
        env.count("SELECT sum(points)::int8 FROM balances").await,
        expected_points
    );
    env.cleanup().await;
}

/// Malformed JSON, a missing field and a negative amount are dead-lettered with their reason;
/// the good messages around them are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_with_a_reason() {
    let env = TestEnv::new("poison").await;
    let host = env.start_host(env.config("loyalty", ""));

    env.publish(&order(1, 1, 1000)).await;
    env.publish(b"{\"order_id\": 2, \"customer_id\": ").await;
    env.publish(br#"{"order_id": 3, "total_cents": 500}"#).await;
    env.publish(&order(4, 1, -500)).await;
    env.publish(&[0xff, 0xfe, 0x00]).await;
    env.publish(&order(5, 1, 2000)).await;

    wait_for("five dead letters", Duration::from_secs(30), || async {
        env.ready(&env.dead_letter_queue).await == 4
    })
    .await;
    wait_drained(&env).await;
    host.stop().await.expect("host stops cleanly");

    let dead = env.drain(&env.dead_letter_queue).await;
    let reason_of = |fragment: &str| -> String {
        dead.iter()
            .find(|(body, _)| body.contains(fragment))
            .and_then(|(_, headers)| headers.iter().find(|(name, _)| name == "x-idem-reason"))
            .map(|(_, reason)| reason.clone())
            .unwrap_or_else(|| panic!("no dead letter whose body contains {fragment:?}: {dead:?}"))
    };
    assert!(reason_of("\"order_id\": 2,").contains("not valid JSON"));
    assert!(reason_of("\"order_id\": 3,").contains("missing field \"customer_id\""));
    assert!(reason_of("-500").contains("\"total_cents\" must not be negative"));
    assert!(reason_of("\u{fffd}").contains("not valid JSON"));
    for (_, headers) in &dead {
        assert!(
            headers
                .iter()
                .any(|(name, value)| name == "x-idem-error-kind" && value == "invalid-input"),
            "{headers:?}"
        );
    }
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 2);
    assert_eq!(
        env.count("SELECT points FROM balances WHERE customer_id = 1")
            .await,
        30
    );
    assert_eq!(env.ready(&env.queue).await, 0);
    env.cleanup().await;
}

/// A plugin that traps, loops or allocates without bound loses only its own message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_plugin_calls_are_dead_lettered_and_the_host_keeps_serving() {
    let env = TestEnv::new("misbehave").await;
    let host = env.start_host(env.config(
        "chaos",
        "max_attempts = 3\n[pipelines.loyalty.limits]\ndeadline_ms = 300\nmemory_mib = 32",
    ));
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

    env.publish(&echo(1)).await;
    for action in ["trap", "loop", "alloc", "retry"] {
        env.publish(format!("{{\"action\": \"{action}\"}}").as_bytes())
            .await;
    }
    env.publish(&echo(2)).await;

    wait_for("four dead letters", Duration::from_secs(60), || async {
        env.ready(&env.dead_letter_queue).await == 4
    })
    .await;
    wait_drained(&env).await;
    assert!(!host.is_finished(), "the host stopped");
    host.stop().await.expect("host stops cleanly");

    let dead = env.drain(&env.dead_letter_queue).await;
    let kind_of = |action: &str| -> String {
        dead.iter()
            .find(|(body, _)| body.contains(action))
            .and_then(|(_, headers)| headers.iter().find(|(name, _)| name == "x-idem-error-kind"))
            .map(|(_, kind)| kind.clone())
            .unwrap_or_else(|| panic!("no dead letter for {action}: {dead:?}"))
    };
    assert_eq!(kind_of("trap"), "plugin-trap");
    assert_eq!(kind_of("loop"), "plugin-deadline");
    assert_eq!(kind_of("alloc"), "plugin-memory");
    assert_eq!(kind_of("retry"), "retries-exhausted");
    let retried = dead
        .iter()
        .find(|(body, _)| body.contains("retry"))
        .expect("retry dead letter");
    assert!(
        retried
            .1
            .iter()
            .any(|(name, value)| name == "x-idem-reason"
                && value.contains("gave up after 3 attempts")),
        "{retried:?}"
    );
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 2);
    env.assert_loyalty_consistent().await;
    env.cleanup().await;
}

/// The channel's ack owner under settlement in any order: 300 deliveries on one channel are
/// settled concurrently in a shuffled order (some after a delay, one in ten with a requeueing
/// nack), so `multiple` acks and single ones interleave. Every settlement is sent, the
/// channel stays open (an ack for an unknown or already acked tag would close it), nothing
/// stays unacked, and exactly the nacked messages are back in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_ack_owner_settles_deliveries_in_any_order_without_losing_the_channel() {
    use futures::StreamExt;
    use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
    use lapin::types::{FieldTable, ShortString};

    let env = TestEnv::new("ackowner").await;
    const MESSAGES: u64 = 300;
    for order_id in 0..MESSAGES {
        env.publish(&order(order_id as i64, 1, 100)).await;
    }
    let (_connection, channel) = idem_e2e::connect_channel().await;
    channel
        .basic_qos(MESSAGES as u16, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(
            ShortString::from(env.queue.as_str()),
            ShortString::from("ack-owner-test"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let acks = idem_host::source::rabbitmq::Acks::spawn(channel.clone());
    let pipeline = env.config("loyalty", "").pipelines.remove(0);
    let mut receipts = Vec::new();
    while (receipts.len() as u64) < MESSAGES {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery within 10 s")
            .expect("consumer open")
            .expect("delivery");
        receipts.push(
            idem_host::source::rabbitmq::receive(
                &pipeline.name,
                match &pipeline.source {
                    idem_host::config::SourceConfig::RabbitMq(queues) => queues,
                    other => panic!("a RabbitMQ pipeline, not {other:?}"),
                },
                delivery,
                &acks,
            )
            .1,
        );
    }
    channel
        .basic_cancel(
            ShortString::from("ack-owner-test"),
            BasicCancelOptions::default(),
        )
        .await
        .expect("cancel");
    // A fixed permutation (a multiplicative step coprime with 300) and fixed delays.
    let order_of = |index: u64| (index * 7 + 11) % MESSAGES;
    let settled = (0..MESSAGES).map(|index| {
        let receipt = &receipts[order_of(index) as usize];
        async move {
            tokio::time::sleep(Duration::from_millis((index * 13) % 40)).await;
            if receipt.delivery_tag % 10 == 3 {
                (true, receipt.nack_requeue().await)
            } else {
                (false, receipt.ack().await)
            }
        }
    });
    let settled = futures::future::join_all(settled).await;
    let nacked = settled.iter().filter(|(nack, _)| *nack).count() as u32;
    assert!(
        settled.iter().all(|(_, done)| *done),
        "a settlement was not sent"
    );
    assert!(
        channel.status().connected(),
        "the broker closed the channel"
    );
    wait_for(
        "the nacked messages back in the queue",
        Duration::from_secs(20),
        || async { env.ready(&env.queue).await == nacked && unacked(&env.queue) == 0 },
    )
    .await;
    env.cleanup().await;
}

/// `[amqp] url` as a list of a cluster's nodes (two addresses in front of the local broker
/// stand in for two nodes): when the node idem is connected to goes away under load (its
/// connections cut, its address refusing), idem moves to the next node, and every order
/// applies once with nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_nodes_moves_to_another_when_one_goes_away() {
    let env = TestEnv::new("amqp_nodes").await;
    let broker: std::net::SocketAddr = "127.0.0.1:5672".parse().expect("address");
    let first = Proxy::start(broker).await;
    let second = Proxy::start(broker).await;
    let node = |port: u16| format!("\"amqp://guest:guest@127.0.0.1:{port}/%2f\"");
    let text = env.config_text("loyalty", "");
    let plain = format!("url = \"{}\"\n", idem_e2e::amqp_url());
    assert!(text.contains(&plain), "config layout changed: {text}");
    let text = text.replace(
        &plain,
        &format!("url = [{}, {}]\n", node(first.port), node(second.port)),
    );
    let config = Config::from_toml(Path::new("/tmp/idem-amqp-nodes.toml"), &text).expect("config");
    let host = env.start_host(config);
    let total = |order_id: i64| 100 + (order_id * 37) % 10_000;
    for order_id in 1..=300 {
        env.publish(&order(order_id, order_id % 20, total(order_id)))
            .await;
    }
    wait_for(
        "orders applied through the first node",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await >= 50 },
    )
    .await;
    // The first node dies: what it carried is cut, and its address refuses from now on.
    first.cut_all();
    drop(first);
    for order_id in 301..=600 {
        env.publish(&order(order_id, order_id % 20, total(order_id)))
            .await;
    }
    wait_for("600 ledger rows", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 600
    })
    .await;
    wait_drained(&env).await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(
        env.ready(&env.dead_letter_queue).await,
        0,
        "messages dead-lettered"
    );
    env.assert_loyalty_consistent().await;
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        600
    );
    drop(second);
    env.cleanup().await;
}

/// A node whose host died without a word (it accepts nothing and refuses nothing: the
/// packets vanish) first in `[amqp] url`: the next node is tried beside it after a moment, so
/// the host consumes within seconds instead of waiting out the connect timeout (15 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_node_does_not_hold_up_the_next() {
    let env = TestEnv::new("amqp_silent").await;
    // Accepts connections and never answers: an AMQP handshake there waits forever.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let silent_port = silent.local_addr().expect("address").port();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let text = env.config_text("loyalty", "");
    let plain = format!("url = \"{}\"\n", idem_e2e::amqp_url());
    assert!(text.contains(&plain), "config layout changed: {text}");
    let text = text.replace(
        &plain,
        &format!(
            "url = [\"amqp://guest:guest@127.0.0.1:{silent_port}/%2f\", \"{}\"]\n",
            idem_e2e::amqp_url()
        ),
    );
    let config = Config::from_toml(Path::new("/tmp/idem-amqp-silent.toml"), &text).expect("config");
    let started = std::time::Instant::now();
    let host = env.start_host(config);
    env.publish(&order(1, 1, 1_000)).await;
    wait_for(
        "the order applied through the next node",
        Duration::from_secs(30),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 1 },
    )
    .await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "consuming began {took:?} after start: the silent node held up the next"
    );
    host.stop().await.expect("host stops cleanly");
    holder.abort();
    env.cleanup().await;
}
