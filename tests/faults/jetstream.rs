//! NATS restarted under load: the scenario runs its own nats-server (JetStream on, its own
//! port and store), kills it with SIGKILL twice while orders flow and starts it again on the
//! same store; every order is credited once and the consumer ends with nothing pending.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_e2e::jetstream::{NatsServer, TestStream};
use idem_e2e::{TestEnv, free_port, order, plugin_path, spawn_idem, wait_for};

use super::{SERIAL, sized, stop};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_killed_and_restarted_under_load() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_nats").await;
    let store = std::env::temp_dir().join(format!("{}-nats", env.database));
    let mut server = NatsServer::start(free_port(), store);
    let stream = Arc::new(TestStream::on(&server.url(), &env.queue).await);
    let text = format!(
        "{}{}",
        env.config_header(),
        stream.pipeline_table(
            "loyalty",
            &plugin_path("loyalty"),
            ", ack_wait = \"5s\"",
            ""
        )
    );
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, &text).expect("write config");
    let host = spawn_idem(&path, &[]);

    let orders = sized(2_000, 10_000) as i64;
    let published = Arc::new(AtomicU64::new(0));
    let publisher = {
        let stream = Arc::clone(&stream);
        let published = Arc::clone(&published);
        tokio::spawn(async move {
            for order_id in 0..orders {
                let body = order(order_id, order_id % 37, 100 + order_id % 900);
                // Until the stream confirms it; a try whose confirmation was lost may have
                // been stored too, and idem makes that copy a duplicate.
                while !stream.try_publish(&body).await {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                published.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut kills = 0;
    for _ in 0..2 {
        let before = published.load(Ordering::Relaxed);
        wait_for("orders flowing", Duration::from_secs(60), || async {
            published.load(Ordering::Relaxed) >= before + orders as u64 / 4
        })
        .await;
        server.kill();
        kills += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
        server.restart();
    }
    publisher.await.expect("publisher");
    wait_for("every order credited", Duration::from_secs(180), || async {
        env.count("SELECT count(DISTINCT order_id) FROM point_ledger")
            .await
            == orders
    })
    .await;
    wait_for(
        "the consumer to hold nothing",
        Duration::from_secs(120),
        || async { stream.consumer_counts("idem-loyalty").await == Some((0, 0)) },
    )
    .await;
    stop(host);
    let ledger = env.count("SELECT count(*) FROM point_ledger").await;
    eprintln!(
        "faults: nats-server killed {kills} times under load: {orders} orders, {ledger} ledger rows"
    );
    assert_eq!(ledger, orders, "an order credited twice");
    env.assert_loyalty_consistent().await;
    assert!(stream.dead_letters().await.is_empty(), "nothing rejected");
    let _ = std::fs::remove_file(path);
    Arc::into_inner(stream)
        .expect("publisher done")
        .cleanup()
        .await;
    drop(server);
    env.cleanup().await;
}
