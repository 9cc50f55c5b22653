//! A RabbitMQ memory alarm under load: the broker stops reading from every connection that
//! publishes. The scenario starts a node of its own, queues 400 orders of which every tenth is
//! malformed (its dead letter is a publish), raises the alarm, then starts a host. Dead
//! letters wait for the alarm to end; the good orders do not: their acks leave on the
//! consumer's connection, which publishes nothing. After the alarm, every malformed order is
//! dead-lettered once and every good one credited once.

use std::path::Path;
use std::time::Duration;

use idem_e2e::rabbit_cluster::Cluster;
use idem_e2e::soak::RabbitPublisher;
use idem_e2e::{TestEnv, order, wait_for};
use idem_host::config::Config;

use super::SERIAL;

const ORDERS: i64 = 400;

fn malformed(order_id: i64) -> bool {
    order_id % 10 == 3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_alarm_holds_dead_letters_not_the_pipeline() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_alarm").await;
    let label = env.database.replace('_', "-");
    let cluster = tokio::task::spawn_blocking(move || Cluster::start(&label, 1))
        .await
        .expect("node started");
    let node = cluster.nodes[0].name.clone();
    let text = env.config_text("loyalty", "").replace(
        &format!("url = \"{}\"\n", idem_e2e::amqp_url()),
        &format!("url = \"{}\"\n", cluster.url(0)),
    );
    assert!(
        text.contains(&cluster.url(0)),
        "config layout changed: {text}"
    );
    let config =
        || Config::from_toml(Path::new("/tmp/idem-fault-alarm.toml"), &text).expect("config");
    // A first host declares the queues on the node, then stops.
    env.start_host(config())
        .stop()
        .await
        .expect("host stops cleanly");
    let mut publisher = RabbitPublisher::to(&cluster.url(0));
    for order_id in 0..ORDERS {
        let body = if malformed(order_id) {
            b"{\"order_id\": \"not a number\"}".to_vec()
        } else {
            order(order_id, order_id % 7, 100 + order_id)
        };
        publisher.publish(&env.queue, &body).await;
    }
    drop(publisher);
    cluster.ctl(&node, &["set_vm_memory_high_watermark", "0.000001"]);
    let good = ORDERS - (0..ORDERS).filter(|id| malformed(*id)).count() as i64;
    let host = env.start_host(config());
    let during = tokio::time::timeout(Duration::from_secs(30), async {
        while env.count("SELECT count(*) FROM point_ledger").await < good {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let applied_during = env.count("SELECT count(*) FROM point_ledger").await;
    cluster.ctl(&node, &["set_vm_memory_high_watermark", "0.4"]);
    assert!(
        during.is_ok(),
        "only {applied_during} of {good} good orders applied in 30 s of the alarm"
    );
    wait_for(
        "every malformed order dead-lettered",
        Duration::from_secs(120),
        || async { cluster.messages(0, &env.dead_letter_queue) == (ORDERS - good) as u64 },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, good);
    assert_eq!(cluster.messages(0, &env.queue), 0, "left on the queue");
    drop(cluster);
    env.cleanup().await;
}
