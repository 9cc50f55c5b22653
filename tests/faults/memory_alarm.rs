//! A RabbitMQ memory alarm under load: the broker stops reading from connections that
//! publish. The scenario starts a node of its own and queues 400 orders of which every tenth
//! is malformed (its dead letter is a publish); a host works through them (each good order
//! takes 0.2 s) and the alarm rises meanwhile. The dead letters' copies wait, parked off
//! their workers (a copy that waited for a confirm gives up after `CONFIRM_WAIT`), and what
//! was delivered keeps being applied. Acks wait too: lapin stops writing on every connection
//! the broker says it blocks, the consumer's included, so the prefetch bounds what is applied
//! during the alarm. After it, every malformed order is dead-lettered once and every good one
//! credited once.

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
async fn a_memory_alarm_loses_and_doubles_nothing() {
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
    // The queues on the node, as the host declares them.
    let (connection, channel) = idem_e2e::connect_channel_to(&cluster.url(0)).await;
    for queue in [&env.queue, &env.dead_letter_queue] {
        idem_e2e::declare_durable(&channel, queue).await;
    }
    drop(channel);
    drop(connection);
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
    // Each good order takes 0.2 s to apply, so the host is still at it when the alarm rises.
    env.slow_ledger("true", 0.2).await;
    let good = ORDERS - (0..ORDERS).filter(|id| malformed(*id)).count() as i64;
    let host = env.start_host(config());
    wait_for(
        "the first orders applied",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await >= 20 },
    )
    .await;
    cluster.ctl(&node, &["set_vm_memory_high_watermark", "0.000001"]);
    // The memory monitor raises the alarm at its next check.
    wait_for("the memory alarm", Duration::from_secs(30), || async {
        cluster
            .ctl(&node, &["eval", "rabbit_alarm:get_alarms()."])
            .contains("memory")
    })
    .await;
    assert!(
        !publishes_within(&cluster.url(0), Duration::from_secs(3)).await,
        "the memory alarm does not block publishers"
    );
    let before = env.count("SELECT count(*) FROM point_ledger").await;
    assert!(
        before < good - 100,
        "too little left to apply during the alarm ({before})"
    );
    // Copies wait, parked off their workers: what was delivered keeps being applied.
    wait_for(
        "orders applied during the alarm",
        Duration::from_secs(40),
        || async { env.count("SELECT count(*) FROM point_ledger").await > before + 50 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster.ctl(&node, &["set_vm_memory_high_watermark", "0.4"]);
    wait_for(
        "every good order applied",
        Duration::from_secs(120),
        || async { env.count("SELECT count(*) FROM point_ledger").await == good },
    )
    .await;
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

/// Whether a publish on a connection of its own is confirmed within `wait`.
async fn publishes_within(url: &str, wait: Duration) -> bool {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::ShortString;
    let (_connection, channel) = idem_e2e::connect_channel_to(url).await;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let confirmed = async {
        channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from("idem-alarm-probe"),
                BasicPublishOptions::default(),
                b"probe",
                lapin::BasicProperties::default(),
            )
            .await?
            .await
    };
    matches!(tokio::time::timeout(wait, confirmed).await, Ok(Ok(_)))
}
