//! Stopping the bleeding without stopping the host: an operator pauses one pipeline on one
//! host (the admin API), or on every host running it (`idem pause`, recorded in the
//! database), and resumes it; nothing is lost or applied twice, and a paused host holds no
//! message.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use idem_e2e::{TestEnv, free_port, http_send, idem_binary, order, wait_for};
use idem_host::config::Config;

const TOKEN: &str = "pause-token-0123456789abcdef012345";

/// `idem <args> --config <path>`: its output; it must succeed.
fn idem(path: &Path, args: &[&str]) -> String {
    idem_e2e::must_run(
        Command::new(idem_binary())
            .args(args)
            .arg("--config")
            .arg(path),
    )
}

/// A `POST` to a host's admin API with the token; status and JSON answer.
async fn post(port: u16, path: &str, json: Option<&str>) -> (u16, serde_json::Value) {
    let bearer = format!("Bearer {TOKEN}");
    let (status, body) = http_send(port, "POST", path, &[("Authorization", &bearer)], json).await;
    (status, serde_json::from_str(&body).unwrap_or_default())
}

/// The operator's pause of `loyalty` as the host at `port` reports it.
async fn operator_pause(port: u16) -> serde_json::Value {
    let bearer = format!("Bearer {TOKEN}");
    let (_, body) = http_send(
        port,
        "GET",
        "/admin/status",
        &[("Authorization", &bearer)],
        None,
    )
    .await;
    let status: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    status["pipelines"][0]["operator_pause"].clone()
}

/// Two hosts of one pipeline. A pause on one (the admin API) stops that one only; it stays
/// ready (`/admin/status` and a gauge say why); the other host takes every message. `idem pause` stops both within
/// seconds: they settle what they started and give back what they prefetched (every message
/// published meanwhile waits on the queue, none unacknowledged), and a restarted host stays
/// paused. `idem resume` resumes both, and every order is credited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_paused_here_or_everywhere_loses_nothing() {
    let env = TestEnv::new("pause").await;
    let path = env.write_config("loyalty", "");
    let host_config = |port: u16| {
        let text = format!(
            "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\nadmin_token = \"{TOKEN}\"\n",
            env.config_text("loyalty", "")
        );
        Config::from_toml(&path, &text).expect("config")
    };
    let (first, second) = (free_port(), free_port());
    let host_one = env.start_host(host_config(first));
    let mut host_two = env.start_host(host_config(second));
    for port in [first, second] {
        wait_for("the HTTP endpoint", Duration::from_secs(30), || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
    }

    // Paused on the first host only: the second takes everything.
    let (status, paused) = post(
        first,
        "/admin/pipelines/loyalty/pause",
        Some(r#"{"reason": "investigating a bad deploy"}"#),
    )
    .await;
    assert_eq!(status, 200, "{paused}");
    assert_eq!(paused["persistent"], false, "{paused}");
    // Intended, so the host stays ready (a rolling deploy is not held up by a paused
    // pipeline); the status and a gauge say it.
    let (status, ready) = http_send(first, "GET", "/readyz", &[], None).await;
    assert_eq!(status, 200, "{ready}");
    let held = operator_pause(first).await;
    assert_eq!(held["reason"], "investigating a bad deploy", "{held}");
    let (_, metrics) = http_send(first, "GET", "/metrics", &[], None).await;
    assert!(
        metrics.contains("idem_pipeline_operator_paused{pipeline=\"loyalty\"} 1"),
        "{metrics}"
    );
    for order_id in 1..=200 {
        env.publish(&order(order_id, order_id % 9, 1_000)).await;
    }
    wait_for(
        "200 credited by the second host",
        Duration::from_secs(60),
        || async { env.count("SELECT count(*) FROM point_ledger").await == 200 },
    )
    .await;

    // Paused everywhere: nothing more is applied, and nothing is held.
    let said = idem(
        &path,
        &["pause", "--pipeline", "loyalty", "--reason", "bad plugin"],
    );
    assert!(
        said.contains("every host running it stops consuming"),
        "{said}"
    );
    for port in [first, second] {
        wait_for(
            "the recorded pause applied",
            Duration::from_secs(20),
            || async { operator_pause(port).await["persistent"] == true },
        )
        .await;
    }
    assert_eq!(operator_pause(first).await["reason"], "bad plugin");
    for order_id in 201..=400 {
        env.publish(&order(order_id, order_id % 9, 1_000)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 200);
    assert_eq!(
        env.ready(&env.queue).await,
        200,
        "every message waits on the queue, none held by a paused host"
    );

    // A restarted host reads the pause before it consumes.
    host_two.stop().await.expect("host stops");
    host_two = env.start_host(host_config(second));
    wait_for(
        "the restarted host paused",
        Duration::from_secs(30),
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", second))
                .await
                .is_ok()
                && operator_pause(second).await["persistent"] == true
        },
    )
    .await;
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 200);

    let said = idem(&path, &["resume", "--pipeline", "loyalty"]);
    assert!(said.contains("resumed"), "{said}");
    wait_for("all 400 credited", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 400
    })
    .await;
    for port in [first, second] {
        wait_for("both hosts resumed", Duration::from_secs(20), || async {
            operator_pause(port).await.is_null()
        })
        .await;
    }
    // A pause of one host, ended through the API.
    let (status, _) = post(first, "/admin/pipelines/loyalty/pause", Some("{}")).await;
    assert_eq!(status, 200);
    let (status, resumed) = post(first, "/admin/pipelines/loyalty/resume", None).await;
    assert_eq!(status, 200, "{resumed}");
    assert_eq!(resumed["was_paused"], true, "{resumed}");
    wait_for(
        "the first host ready again",
        Duration::from_secs(30),
        || async { http_send(first, "GET", "/readyz", &[], None).await.0 == 200 },
    )
    .await;
    host_one.stop().await.expect("host stops");
    host_two.stop().await.expect("host stops");
    env.assert_loyalty_consistent().await;
    let _ = std::fs::remove_file(&path);
    env.cleanup().await;
}
