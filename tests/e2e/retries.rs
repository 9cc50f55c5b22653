//! Retries the plugin asks for, on RabbitMQ: waited out in a delay queue of idem's
//! (`<queue>.idem-delay.<ms>ms`), off the worker, for as long as `[pipelines.<name>.retry]`
//! says.

use std::path::Path;
use std::time::{Duration, Instant};

use idem_e2e::{TestEnv, queue_waiting, wait_for};
use idem_host::config::Config;

/// The delay queue a 30 s wait lands in: the grid's first step at least 30 s long (100 ms ×
/// 1.25^26).
const THIRTY_SECONDS_STEP: &str = "idem-delay.33087ms";

/// One worker; a message whose plugin asks for a retry, with `retry.initial = "30s"`: while
/// it waits, 50 messages behind it are applied by that one worker. It waits in the delay
/// queue, not on the worker nor unacked, and comes back after its wait for its second and
/// last try (`max_attempts = 2`), which dead-letters it: it went around.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thirty_second_retry_holds_no_worker() {
    let env = TestEnv::new("retry_delay").await;
    let text = env
        .config_text(
            "chaos",
            "max_attempts = 2\n\n[pipelines.loyalty.retry]\ninitial = \"30s\"\njitter = 0.0\n",
        )
        .replace("workers = 8", "workers = 1");
    let config = Config::from_toml(Path::new("/tmp/idem-retry.toml"), &text).expect("config");
    let host = env.start_host(config);
    let delay_queue = format!("{}.{THIRTY_SECONDS_STEP}", env.queue);
    let retried_at = Instant::now();
    env.publish(br#"{"action": "retry"}"#).await;
    wait_for(
        "the retry in its delay queue",
        Duration::from_secs(30),
        || async { queue_waiting(&delay_queue).await == Some(1) },
    )
    .await;
    for order_id in 1..=50 {
        let body = serde_json::json!({
            "key": format!("order:{order_id}"),
            "effects": [{"statement": "record_ledger", "params": [1, order_id, 10]}],
        });
        env.publish(body.to_string().as_bytes()).await;
    }
    wait_for("50 orders applied", Duration::from_secs(20), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 50
    })
    .await;
    assert!(
        retried_at.elapsed() < Duration::from_secs(30),
        "the orders took the whole wait: {:?}",
        retried_at.elapsed()
    );
    assert_eq!(queue_waiting(&delay_queue).await, Some(1), "still waiting");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);
    wait_for("the second try", Duration::from_secs(60), || async {
        env.ready(&env.dead_letter_queue).await == 1
    })
    .await;
    assert!(
        retried_at.elapsed() >= Duration::from_secs(30),
        "came back after {:?}",
        retried_at.elapsed()
    );
    host.stop().await.expect("host stops");
    let dead = env.drain(&env.dead_letter_queue).await;
    let header = |name: &str| {
        dead[0]
            .1
            .iter()
            .find(|(header, _)| header == name)
            .map(|(_, value)| value.clone())
    };
    assert_eq!(
        header("x-idem-error-kind").as_deref(),
        Some("retries-exhausted")
    );
    assert_eq!(header("x-idem-attempt").as_deref(), Some("2"), "{dead:?}");
    env.channel_queue_delete(&delay_queue).await;
    env.cleanup().await;
}
