//! A RabbitMQ cluster losing the node that leads the queue: the scenario starts three nodes of
//! its own, clustered, and two hosts given every node's address in a different order; the
//! quorum queue's leader is SIGKILLed while they work through the orders. The queue moves to
//! a surviving node, the hosts connected to the dead one move to another, and every order is
//! credited once with nothing dead-lettered.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use idem_e2e::rabbit_cluster::Cluster;
use idem_e2e::soak::RabbitPublisher;
use idem_e2e::{TestEnv, order, wait_for};
use idem_host::config::Config;

use super::{SERIAL, customer, sized, total};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quorum_queue_leader_killed_under_load_with_two_hosts() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_cluster").await;
    let label = env.database.replace('_', "-");
    let mut cluster = tokio::task::spawn_blocking(move || Cluster::start(&label, 3))
        .await
        .expect("cluster started");
    let host_config = |order: [usize; 3]| {
        let nodes: Vec<String> = order
            .iter()
            .map(|index| format!("\"{}\"", cluster.url(*index)))
            .collect();
        let text = env
            .config_text("loyalty", "queue_type = \"quorum\"")
            .replace(
                &format!("url = \"{}\"\n", idem_e2e::amqp_url()),
                &format!("url = [{}]\n", nodes.join(", ")),
            );
        assert!(text.contains(&nodes[0]), "config layout changed: {text}");
        Config::from_toml(Path::new("/tmp/idem-fault-cluster.toml"), &text).expect("config")
    };
    let first = env.start_host(host_config([0, 1, 2]));
    let second = env.start_host(host_config([1, 2, 0]));
    let leader = {
        let queue = env.queue.clone();
        let mut found = None;
        for _ in 0..120 {
            if let Some(leader) = cluster.try_leader(0, &queue) {
                found = Some(leader);
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        found.expect("the hosts declared the quorum queue")
    };
    // A steady producer on a node that survives, retrying each order until the broker
    // confirms it (a try whose confirm was lost may be stored too: idem makes it a duplicate).
    let orders = sized(3_000, 12_000) as i64;
    let published = Arc::new(AtomicI64::new(0));
    let producer = {
        let url = cluster.url((leader + 1) % 3);
        let queue = env.queue.clone();
        let published = Arc::clone(&published);
        tokio::spawn(async move {
            let mut publisher = RabbitPublisher::to(&url);
            for order_id in 0..orders {
                let body = order(order_id, customer(order_id), total(order_id));
                publisher.publish(&queue, &body).await;
                published.store(order_id + 1, Ordering::Relaxed);
                if order_id % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
    };
    let applied = || env.count("SELECT count(*) FROM point_ledger");
    wait_for(
        "a third published and applied",
        Duration::from_secs(120),
        || async {
            published.load(Ordering::Relaxed) >= orders / 3 && applied().await >= orders / 4
        },
    )
    .await;
    let before = applied().await;
    cluster.kill(leader);
    let killed = Instant::now();
    let resumed_in_time = tokio::time::timeout(Duration::from_secs(120), async {
        while applied().await <= before + 50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        resumed_in_time.is_ok(),
        "consumption did not resume within 120 s of the kill ({before} then {} applied, {} published); the cluster:\n{}",
        applied().await,
        published.load(Ordering::Relaxed),
        cluster.describe((leader + 1) % 3)
    );
    let resumed = killed.elapsed();
    producer.await.expect("producer");
    wait_for("every order applied", Duration::from_secs(180), || async {
        applied().await == orders
    })
    .await;
    println!(
        "cluster: leader {} killed with {before} of {orders} applied; consumption resumed {:.1} s later",
        cluster.nodes[leader].name,
        resumed.as_secs_f64()
    );
    let survivor = (leader + 1) % 3;
    let dead_letters = cluster.messages(survivor, &env.dead_letter_queue);
    assert_eq!(dead_letters, 0, "dead-lettered");
    first.stop().await.expect("the first host stops cleanly");
    second.stop().await.expect("the second host stops cleanly");
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        orders
    );
    env.assert_loyalty_consistent().await;
    drop(cluster);
    env.cleanup().await;
}
