//! Hot swap: replacing a plugin while messages flow loses, doubles and misattributes nothing;
//! a build that is broken, of the wrong world or fails its self-test is refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idem_e2e::{TestEnv, free_port, http_request, order, plugin_path, unacked, wait_for};
use idem_host::telemetry::metrics::Metrics;

/// A private copy of a plugin file, in a directory of its own the host can watch.
fn plugin_slot(env: &TestEnv, initial: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("{}-plugins", env.database));
    std::fs::create_dir_all(&directory).expect("plugin dir");
    let slot = directory.join("current.wasm");
    std::fs::copy(plugin_path(initial), &slot).expect("copy plugin");
    slot
}

/// Replaces `slot` atomically (write aside, then rename), as a deploy would.
fn install(source: &Path, slot: &Path) {
    let staging = slot.with_extension("staging");
    std::fs::copy(source, &staging).expect("stage plugin");
    std::fs::rename(&staging, slot).expect("swap plugin file");
}

fn install_bytes(bytes: &[u8], slot: &Path) {
    let staging = slot.with_extension("staging");
    std::fs::write(&staging, bytes).expect("stage bytes");
    std::fs::rename(&staging, slot).expect("swap plugin file");
}

fn digest_of(path: &Path) -> String {
    use sha2::Digest;
    let bytes = std::fs::read(path).expect("read plugin");
    format!("sha256:{:x}", sha2::Sha256::digest(bytes))
}

fn total(order_id: i64) -> i64 {
    100 + (order_id * 37) % 10_000
}

/// 5,000 orders stream in while the plugin file is swapped 10 times between a build that
/// credits 1 point per dollar and one that credits 2. Every order is credited once, with the
/// points of exactly the build its claim records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapping_under_load_credits_each_order_once_by_the_recorded_build() {
    let env = TestEnv::new("hotswap").await;
    let slot = plugin_slot(&env, "loyalty");
    let metrics = Arc::new(Metrics::new());
    let config_text = env.config_text("loyalty", "").replace(
        &plugin_path("loyalty").display().to_string(),
        &slot.display().to_string(),
    );
    let config = idem_host::config::Config::from_toml(Path::new("/tmp/hotswap.toml"), &config_text)
        .expect("valid config");
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));

    // The stream is paced by the swaps: chunk k is published only once k swaps took effect,
    // so every swap lands while orders are still arriving, however slow the machine is.
    const CHUNKS: i64 = 11;
    let publisher = {
        let queue = env.queue.clone();
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let (_connection, channel) = idem_e2e::connect_channel().await;
            for order_id in 1..=5000 {
                let chunk = (order_id - 1) * CHUNKS / 5000;
                while metrics.plugin_reloads("loyalty", "applied") < chunk as u64 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                idem_e2e::publish(
                    &channel,
                    &queue,
                    &order(order_id, order_id % 40, total(order_id)),
                )
                .await;
            }
        })
    };
    // The watcher starts with the host: swap only once messages are being applied.
    wait_for("the first credit", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await > 0
    })
    .await;
    let builds = [plugin_path("loyalty-bonus"), plugin_path("loyalty")];
    for swap in 0..10u64 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        install(&builds[(swap % 2) as usize], &slot);
        // Each swap must take effect before the next, or the watcher rightly coalesces them.
        wait_for(
            "the swap to take effect",
            Duration::from_secs(30),
            || async { metrics.plugin_reloads("loyalty", "applied") == swap + 1 },
        )
        .await;
    }
    assert!(
        env.count("SELECT count(*) FROM point_ledger").await < 5000,
        "the swaps should happen under load"
    );
    // The watcher reacts to writes only: reading the file to reload it must not trigger
    // another reload (an endless loop of "unchanged").
    tokio::time::sleep(Duration::from_secs(1)).await;
    let unchanged = metrics.plugin_reloads("loyalty", "unchanged");
    assert!(unchanged <= 10, "{unchanged} reloads of an unchanged file");
    publisher.await.expect("publisher");

    wait_for("5,000 ledger rows", Duration::from_secs(180), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 5000
    })
    .await;
    wait_for("the queue to drain", Duration::from_secs(60), || async {
        env.ready(&env.queue).await == 0 && unacked(&env.queue) == 0
    })
    .await;
    host.stop().await.expect("host stops cleanly");

    env.assert_loyalty_consistent().await;
    let single = digest_of(&plugin_path("loyalty"));
    let double = digest_of(&plugin_path("loyalty-bonus"));
    let credited_by = |digest: String| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM processed_messages WHERE plugin_digest = $1",
            )
            .bind(digest)
            .fetch_one(&pool)
            .await
            .expect("count by digest")
        }
    };
    let by_single = credited_by(single.clone()).await;
    let by_double = credited_by(double.clone()).await;
    assert_eq!(by_single + by_double, 5000, "claims from an unknown build");
    assert!(
        by_single > 0 && by_double > 0,
        "both builds served: {by_single} / {by_double}"
    );
    let misattributed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM point_ledger l \
         JOIN processed_messages p ON p.message_key = 'order-completed:' || l.order_id \
         WHERE l.points <> ((100 + (l.order_id * 37) % 10000) / 100) \
                          * CASE p.plugin_digest WHEN $1 THEN 1 WHEN $2 THEN 2 END",
    )
    .bind(&single)
    .bind(&double)
    .fetch_one(&env.pool)
    .await
    .expect("attribution query");
    assert_eq!(
        misattributed, 0,
        "orders credited differently from the build their claim records"
    );
    assert_eq!(metrics.plugin_reloads("loyalty", "applied"), 10);
    assert_eq!(metrics.plugin_reloads("loyalty", "refused"), 0);
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);
    let _ = std::fs::remove_dir_all(slot.parent().expect("slot dir"));
    env.cleanup().await;
}

/// Through the admin API: a corrupt file, a component of another world and a build that fails
/// the self-test are refused, visibly, and the serving build keeps applying messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_builds_are_refused_and_the_old_build_keeps_serving() {
    let env = TestEnv::new("refused").await;
    let slot = plugin_slot(&env, "loyalty");
    let self_test = slot.with_file_name("self-test.json");
    std::fs::write(&self_test, order(1, 1, 100)).expect("self-test message");
    let port = free_port();
    let token = "s3cret-token-0123456789abcdef01234";
    let config_text = format!(
        "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\nadmin_token = \"{token}\"\n",
        env.config_text(
            "loyalty",
            &format!("watch = false\nself_test = \"{}\"", self_test.display())
        )
        .replace(
            &plugin_path("loyalty").display().to_string(),
            &slot.display().to_string()
        )
    );
    let config = idem_host::config::Config::from_toml(Path::new("/tmp/refused.toml"), &config_text)
        .expect("valid config");
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    let serving = digest_of(&plugin_path("loyalty"));
    wait_for("the HTTP endpoint", Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;

    let (status, _) = http_request(port, "GET", "/admin/status", None).await;
    assert_eq!(
        status, 401,
        "once a token is set, reads need it (loopback too)"
    );
    let (status, _) = http_request(port, "GET", "/admin/status", Some(token)).await;
    assert_eq!(status, 200);
    let (status, _) = http_request(port, "POST", "/admin/reload/loyalty", None).await;
    assert_eq!(status, 401, "an action must require the token");

    let read = |name: &str| std::fs::read(plugin_path(name)).expect("read plugin");
    let attempts = [
        (
            "corrupt",
            b"\0asm this is not a component".to_vec(),
            "not a valid",
        ),
        ("wrong world", read("other-world"), "handler"),
        ("self-test", read("chaos"), "self-test"),
    ];
    for (case, bytes, expected) in &attempts {
        install_bytes(bytes, &slot);
        let (status, body) = http_request(port, "POST", "/admin/reload/loyalty", Some(token)).await;
        assert_eq!(status, 422, "{case}: {body}");
        assert!(
            body.contains("refused") && body.contains(expected),
            "{case}: {body}"
        );
        let (_, status_body) = http_request(port, "GET", "/admin/status", Some(token)).await;
        let status_json: serde_json::Value =
            serde_json::from_str(&status_body).expect("status JSON");
        let pipeline = &status_json["pipelines"][0];
        assert_eq!(
            pipeline["plugin"]["digest"],
            serving.as_str(),
            "{case}: {status_body}"
        );
        assert!(
            pipeline["last_reload_error"]
                .as_str()
                .is_some_and(|error| error.contains(expected)),
            "{case}: {status_body}"
        );
    }

    // The old build still serves.
    env.publish(&order(77, 2, 7700)).await;
    wait_for(
        "order 77 to be credited",
        Duration::from_secs(30),
        || async {
            env.count("SELECT count(*) FROM point_ledger WHERE order_id = 77")
                .await
                == 1
        },
    )
    .await;
    let recorded: String = sqlx::query_scalar(
        "SELECT plugin_digest FROM processed_messages WHERE message_key = 'order-completed:77'",
    )
    .fetch_one(&env.pool)
    .await
    .expect("claim");
    assert_eq!(recorded, serving);

    install(&plugin_path("loyalty-bonus"), &slot);
    let (status, body) = http_request(port, "POST", "/admin/reload/loyalty", Some(token)).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("swapped"), "{body}");
    let (_, metrics_text) = http_request(port, "GET", "/metrics", None).await;
    assert!(
        metrics_text
            .contains(r#"idem_plugin_reloads_total{pipeline="loyalty",result="refused"} 3"#),
        "{metrics_text}"
    );
    assert!(
        metrics_text
            .contains(r#"idem_plugin_reloads_total{pipeline="loyalty",result="applied"} 1"#),
        "{metrics_text}"
    );
    let (status, _) = http_request(port, "GET", "/healthz", None).await;
    assert_eq!(status, 200);
    let (status, body) = http_request(port, "GET", "/readyz", None).await;
    assert_eq!(status, 200, "{body}");

    host.stop().await.expect("host stops cleanly");
    assert_eq!(metrics.plugin_reloads("loyalty", "refused"), 3);
    let _ = std::fs::remove_dir_all(slot.parent().expect("slot dir"));
    env.cleanup().await;
}
