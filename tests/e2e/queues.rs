//! Queues as users declare them: quorum queues (with a delivery limit and the broker's own
//! dead-lettering), queues owned by infrastructure code (`declare = false`), and the broker
//! refusals no retry can fix (a wrong password or vhost, a queue declared otherwise), which
//! stop `idem run` and `idem check` within 10 s naming the setting.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicNackOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, LongString, ShortString};

use idem_e2e::{
    TestEnv, amqp_url, must_refuse, order, quorum_arguments, redeclare, spawn_idem, wait_for,
};

/// A quorum queue declared by infrastructure code with a delivery limit, used as it is
/// (`declare = false`; its dead-letter queue does not exist and idem declares it): 2,000
/// orders and 200 duplicate deliveries, the host killed mid-run and restarted. Every order is
/// credited exactly once and nothing is dropped or dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_predeclared_quorum_queue_gets_every_order_once_across_a_kill() {
    let env = TestEnv::new("quorum_kill").await;
    redeclare(&env.channel, &env.queue, quorum_arguments(Some(5))).await;
    env.channel
        .queue_delete(
            ShortString::from(env.dead_letter_queue.as_str()),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .expect("delete the dead-letter queue");
    let config_path = env.write_config("loyalty", "declare = false\nqueue_type = \"quorum\"");
    let orders = 2_000;
    let mut host = spawn_idem(&config_path, &[]);
    for order_id in 1..=orders {
        env.publish(&order(order_id, order_id % 37, 1_000 + order_id))
            .await;
        if order_id % 10 == 0 {
            env.publish(&order(
                order_id - 5,
                (order_id - 5) % 37,
                1_000 + order_id - 5,
            ))
            .await;
        }
        if order_id == 800 {
            wait_for("a few hundred credits", Duration::from_secs(60), || async {
                env.count("SELECT count(*) FROM point_ledger").await >= 300
            })
            .await;
            host.kill().expect("kill -9 the host");
            host.wait().expect("reap the host");
            host = spawn_idem(&config_path, &[]);
        }
    }
    wait_for("every order credited", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == orders
    })
    .await;
    wait_for("the queue drained", Duration::from_secs(30), || async {
        env.ready(&env.queue).await == 0 && idem_e2e::unacked(&env.queue) == 0
    })
    .await;
    host.kill().expect("stop the host");
    host.wait().expect("reap the host");
    env.assert_loyalty_consistent().await;
    assert_eq!(
        env.count("SELECT count(DISTINCT order_id) FROM point_ledger")
            .await,
        orders
    );
    assert_eq!(
        env.ready(&env.dead_letter_queue).await,
        0,
        "a message was dead-lettered"
    );
    env.cleanup().await;
}

/// A quorum queue idem declares with `x-delivery-limit = 2` dead-letters a message pushed
/// over the limit (three requeues by a misbehaving consumer) into the pipeline's dead-letter
/// queue, with the broker's `x-death`: it is never dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_delivery_limit_lands_in_the_dead_letter_queue() {
    let env = TestEnv::new("quorum_limit").await;
    for queue in [&env.queue, &env.dead_letter_queue] {
        env.channel
            .queue_delete(
                ShortString::from(queue.as_str()),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await
            .expect("delete queue");
    }
    let config_path = env.write_config(
        "loyalty",
        "queue_type = \"quorum\"\nqueue_arguments = { \"x-delivery-limit\" = 2 }",
    );
    // `idem check` does not declare; `idem run` does.
    let checked = std::process::Command::new(idem_e2e::idem_binary())
        .args(["check", "--config"])
        .arg(&config_path)
        .output()
        .expect("run idem check");
    let printed = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success(), "{printed}");
    assert!(
        printed.contains("will be declared by idem run (quorum"),
        "{printed}"
    );
    let mut host = spawn_idem(&config_path, &[]);
    wait_for("the host consuming", Duration::from_secs(60), || async {
        idem_e2e::consumers(&env.queue) == 1
    })
    .await;
    env.publish(&order(1, 1, 100)).await;
    wait_for(
        "the host applied order 1",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 1 },
    )
    .await;
    host.kill().expect("stop the host");
    host.wait().expect("reap the host");
    // Until the broker has seen the killed host's connection close, it may push the next
    // message to that dead consumer and count its return as a delivery.
    wait_for(
        "the killed host's consumer gone",
        Duration::from_secs(30),
        || async { idem_e2e::consumers(&env.queue) == 0 },
    )
    .await;

    // Another consumer that keeps returning a message it cannot handle.
    let channel = env.live_channel().await;
    channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(env.queue.as_str()),
            BasicPublishOptions::default(),
            b"poison for a bad consumer",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    let mut returned = 0;
    for _ in 0..20 {
        let got = channel
            .basic_get(
                ShortString::from(env.queue.as_str()),
                BasicGetOptions { no_ack: false },
            )
            .await
            .expect("basic.get");
        let Some(message) = got else {
            if env.ready(&env.dead_letter_queue).await == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        message
            .delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await
            .expect("nack");
        returned += 1;
    }
    assert!(returned >= 3, "the message was returned {returned} times");
    wait_for("the dead letter", Duration::from_secs(10), || async {
        env.ready(&env.dead_letter_queue).await == 1
    })
    .await;
    let dead = env.drain(&env.dead_letter_queue).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0, "poison for a bad consumer");
    assert!(
        dead[0].1.iter().any(|(name, _)| name == "x-death"),
        "no x-death header: {:?}",
        dead[0].1
    );
    env.cleanup().await;
}

/// Broker refusals no retry can fix: each makes `idem run` and `idem check` exit non-zero
/// within 10 s, naming the setting to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_configuration_faults_stop_the_host() {
    let env = TestEnv::new("amqp_refusals").await;
    let text = env.config_text("loyalty", "");
    let url = amqp_url();
    let mut cases = vec![
        (
            "wrong password",
            text.replace(&url, &url.replacen("guest:guest", "guest:wrong", 1)),
            "user and password in [amqp] url",
        ),
        (
            "unknown vhost",
            text.replace(&url, &url.replace("/%2f", "/idem-no-such-vhost")),
            "vhost in [amqp] url",
        ),
        (
            // The test queue exists as a classic queue.
            "classic queue, quorum configured",
            env.config_text("loyalty", "queue_type = \"quorum\""),
            "queue_type",
        ),
        (
            "declare = false, queue missing",
            env.config_text("loyalty", "declare = false")
                .replace(&format!("\"{}\"", env.queue), "\"idem-no-such-queue\""),
            "declare = false",
        ),
    ];
    // A quorum queue where the config says classic (the default).
    let (quorum_queue, quorum_dead_letters) = env.extra_queues("quorum").await;
    redeclare(&env.channel, &quorum_queue, quorum_arguments(None)).await;
    cases.push((
        "quorum queue, classic configured",
        env.config_text("loyalty", "")
            .replace(
                &format!("\"{}\"", env.dead_letter_queue),
                &format!("\"{quorum_dead_letters}\""),
            )
            .replace(
                &format!("\"{}\"", env.queue),
                &format!("\"{quorum_queue}\""),
            ),
        "queue_type",
    ));
    let config_path = std::env::temp_dir().join(format!("{}.toml", env.database));
    for (case, text, setting) in cases {
        std::fs::write(&config_path, text).expect("write config");
        for command in ["run", "check"] {
            let output = must_refuse(command, &config_path);
            assert!(output.contains(setting), "{case}: idem {command}: {output}");
            eprintln!("{case}: idem {command}: {}", output.trim());
        }
    }
    let _ = std::fs::remove_file(&config_path);
    env.cleanup().await;
}

/// A dead-letter copy keeps everything but the producer's `expiration` (kept in a header),
/// so it cannot expire out of the dead-letter queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_copies_do_not_expire() {
    let env = TestEnv::new("dead_letter_expiration").await;
    let host = env.start_host(env.config("loyalty", ""));
    env.live_channel()
        .await
        .basic_publish(
            ShortString::from(""),
            ShortString::from(env.queue.as_str()),
            BasicPublishOptions::default(),
            b"not json",
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_expiration(ShortString::from("60000"))
                .with_message_id(ShortString::from("m-1")),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    wait_for("the dead letter", Duration::from_secs(30), || async {
        env.ready(&env.dead_letter_queue).await == 1
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    let message = env
        .live_channel()
        .await
        .basic_get(
            ShortString::from(env.dead_letter_queue.as_str()),
            BasicGetOptions { no_ack: true },
        )
        .await
        .expect("basic.get")
        .expect("a dead letter");
    let properties = &message.delivery.properties;
    assert_eq!(properties.expiration(), &None, "the copy can still expire");
    assert_eq!(
        properties.message_id().as_ref().map(ShortString::as_str),
        Some("m-1")
    );
    let headers = properties.headers().clone().unwrap_or_default();
    assert_eq!(
        headers.inner().get("x-idem-expiration"),
        Some(&AMQPValue::LongString(LongString::from("60000")))
    );
    env.cleanup().await;
}
