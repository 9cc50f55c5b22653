//! The transactional outbox (the guide's Step 6): rows written in the message's transaction,
//! delivered by the relay to an HTTP endpoint with an `Idempotency-Key`, or to an AMQP
//! exchange with publisher confirms, through endpoint failures and a killed relay.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions};
use lapin::types::{FieldTable, ShortString};

use idem_e2e::tls::{HttpsListener, Pki};
use idem_e2e::{TestEnv, order, plugin_path, spawn_idem, wait_for};
use idem_host::config::Config;
use idem_host::telemetry::metrics::Metrics;

/// What the test endpoint saw.
#[derive(Default)]
struct Endpoint {
    /// Every request, in arrival order: its idempotency key (empty if it had none) and
    /// whether it was answered 2xx.
    requests: Vec<(String, bool)>,
    /// Keys seen so far, in first-arrival order.
    first_seen: BTreeMap<String, usize>,
    bodies: BTreeMap<String, String>,
}

type Shared = Arc<Mutex<Endpoint>>;

/// Accepts a receipt, except the first attempt of every tenth new key, which gets a 503.
async fn receive(State(endpoint): State<Shared>, headers: HeaderMap, body: String) -> StatusCode {
    let key = idem_e2e::idempotency_key(&headers)
        .unwrap_or_default()
        .to_string();
    let mut endpoint = endpoint.lock().expect("endpoint state");
    let new_ordinal = if endpoint.first_seen.contains_key(&key) {
        None
    } else {
        let ordinal = endpoint.first_seen.len() + 1;
        endpoint.first_seen.insert(key.clone(), ordinal);
        Some(ordinal)
    };
    let accept = !key.is_empty() && new_ordinal.is_none_or(|ordinal| ordinal % 10 != 0);
    endpoint.requests.push((key.clone(), accept));
    if accept {
        endpoint.bodies.insert(key, body);
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn serve_endpoint() -> (u16, Shared) {
    let shared = Shared::default();
    let router = Router::new()
        .route("/receipts", post(receive))
        .with_state(Arc::clone(&shared));
    (idem_e2e::serve_locally(router).await, shared)
}

pub(crate) fn receipts_config(env: &TestEnv, destination: &str) -> String {
    format!(
        r#"{header}
[outbox]
poll = "50ms"
max_attempts = 20

{destination}

[pipelines.receipts]
queue = "{queue}"
plugin = "{plugin}"
dead_letter_queue = "{dead_letter_queue}"
workers = 4

[pipelines.receipts.statements]
record_receipt = "INSERT INTO receipts (order_id, customer_id, total_cents) VALUES ($1, $2, $3)"
"#,
        header = env.config_header(),
        queue = env.queue,
        dead_letter_queue = env.dead_letter_queue,
        plugin = plugin_path("receipts").display(),
    )
}

/// An exchange for AMQP receipts and a queue of the test's bound to it (`receipt.issued`):
/// `(exchange, queue)`. The queue goes with the test's; the exchange with [`delete_exchange`].
pub(crate) async fn receipts_exchange(env: &TestEnv) -> (String, String) {
    let (queue, _) = env.extra_queues("receipts").await;
    let exchange = format!("{}.receipts", env.queue);
    env.channel
        .exchange_declare(
            ShortString::from(exchange.as_str()),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare exchange");
    env.channel
        .queue_bind(
            ShortString::from(queue.as_str()),
            ShortString::from(exchange.as_str()),
            ShortString::from("receipt.issued"),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind queue");
    (exchange, queue)
}

pub(crate) async fn delete_exchange(env: &TestEnv, exchange: &str) {
    let _ = env
        .channel
        .exchange_delete(
            ShortString::from(exchange),
            ExchangeDeleteOptions::default(),
        )
        .await;
}

#[tokio::test]
async fn outbox_delivers_each_receipt_once_through_failures_and_a_killed_relay() {
    let env = TestEnv::new("outbox_http").await;
    let (port, endpoint) = serve_endpoint().await;
    let config_path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(
        &config_path,
        receipts_config(
            &env,
            &format!(
                "[outbox.destinations.receipts]\nkind = \"http\"\nurl = \"http://127.0.0.1:{port}/receipts\"\ntimeout = \"5s\""
            ),
        ),
    )
    .expect("write config");

    let orders = 500;
    let mut host = spawn_idem(&config_path, &[]);
    for order_id in 1..=orders {
        env.publish(&order(order_id, order_id % 17, 1_000 + order_id))
            .await;
        if order_id == 250 {
            // A message whose transaction rolls back (the CHECK on receipts fails):
            // its outbox row must never exist, so nothing may be delivered for it.
            env.publish(&order(9_999, 1, 500_000_000)).await;
        }
    }
    let accepted = |endpoint: &Shared| endpoint.lock().expect("endpoint state").bodies.len();
    wait_for(
        "a third of the receipts delivered",
        Duration::from_secs(60),
        || {
            let seen = accepted(&endpoint);
            async move { seen >= 150 }
        },
    )
    .await;
    // The relay dies mid-run, rows locked and deliveries in flight.
    host.kill().expect("kill -9 the host");
    host.wait().expect("reap the host");
    let mut host = spawn_idem(&config_path, &[]);
    wait_for(
        "every outbox row delivered",
        Duration::from_secs(120),
        || async {
            env.count("SELECT count(*) FROM idem_outbox WHERE delivered_at IS NOT NULL")
                .await
                == orders
        },
    )
    .await;
    // Give a stray second delivery time to show up before counting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    host.kill().expect("stop the host");
    host.wait().expect("reap the host");

    let Endpoint {
        requests,
        first_seen,
        bodies,
    } = std::mem::take(&mut *endpoint.lock().expect("endpoint state"));
    let expected: BTreeSet<String> = (1..=orders).map(|id| format!("receipt:{id}")).collect();
    let delivered: BTreeSet<String> = bodies.keys().cloned().collect();
    assert_eq!(delivered, expected, "every receipt delivered, by its key");
    assert!(
        requests.iter().all(|(key, _)| !key.is_empty()),
        "a request came without an Idempotency-Key"
    );
    let refused = requests.iter().filter(|(_, ok)| !ok).count();
    let accepted_requests = requests.iter().filter(|(_, ok)| *ok).count();
    assert_eq!(
        refused,
        orders as usize / 10,
        "the first attempt of every tenth receipt failed"
    );
    // At least once: only rows in flight when the relay died may arrive twice, with the same key.
    let repeats = accepted_requests - orders as usize;
    assert!(repeats <= 32, "{repeats} repeated deliveries");
    assert!(!first_seen.contains_key("receipt:9999"));
    let body: serde_json::Value =
        serde_json::from_str(&bodies["receipt:7"]).expect("receipt is JSON");
    assert_eq!(body["order_id"], 7);
    assert_eq!(
        env.count("SELECT count(*) FROM idem_outbox WHERE message_key = 'receipt:9999'")
            .await,
        0
    );
    assert_eq!(env.count("SELECT count(*) FROM receipts").await, orders);
    let backlog = idem_host::store::outbox::backlog(&env.pool, &Default::default())
        .await
        .expect("outbox backlog");
    assert_eq!(
        (backlog.pending, backlog.parked, backlog.delivered),
        (0, 0, orders)
    );
    // Only the rolled-back receipt is dead-lettered. A kill -9 between its copy's confirm
    // and the original's ack dead-letters it once more after the restart (the copy comes
    // before the ack, so never fewer): at most two copies, all of order 9999.
    let dead = env.drain(&env.dead_letter_queue).await;
    assert!(
        (1..=2).contains(&dead.len()),
        "{} dead letters, expected the rolled-back receipt once (twice if the kill fell between its copy and its ack)",
        dead.len()
    );
    assert!(
        dead.iter().all(|(body, _)| body.contains("9999")),
        "only the rolled-back receipt is dead-lettered: {dead:?}"
    );
    assert_eq!(env.ready(&env.queue).await, 0);
    eprintln!(
        "outbox: {orders} receipts, {} requests, {refused} refused first attempts, {repeats} repeats after kill -9",
        requests.len()
    );
    env.cleanup().await;
}

#[tokio::test]
async fn outbox_publishes_to_an_exchange_with_confirms() {
    let env = TestEnv::new("outbox_amqp").await;
    let (exchange, target_queue) = receipts_exchange(&env).await;
    let config = Config::from_toml(
        std::path::Path::new("/tmp/idem-outbox-test.toml"),
        &receipts_config(
            &env,
            &format!(
                "[outbox.destinations.receipts]\nkind = \"amqp\"\nexchange = \"{exchange}\"\nrouting_key = \"receipt.issued\""
            ),
        ),
    )
    .expect("config");
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    for order_id in 1..=20 {
        env.publish(&order(order_id, 3, 2_500)).await;
    }
    wait_for("20 receipts published", Duration::from_secs(60), || async {
        env.ready(&target_queue).await == 20
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    let published = env.drain(&target_queue).await;
    let keys: BTreeSet<String> = published
        .iter()
        .filter_map(|(_, headers)| {
            headers
                .iter()
                .find(|(name, _)| name == "idempotency-key")
                .map(|(_, value)| value.clone())
        })
        .collect();
    assert_eq!(keys.len(), 20, "{published:?}");
    assert!(keys.contains("receipt:20"));
    assert_eq!(
        env.count("SELECT count(*) FROM idem_outbox WHERE delivered_at IS NULL")
            .await,
        0
    );
    delete_exchange(&env, &exchange).await;
    env.cleanup().await;
}

#[tokio::test]
async fn outbox_parks_a_row_after_its_last_attempt() {
    let env = TestEnv::new("outbox_park").await;
    // Nothing listens on this port: every attempt fails to connect.
    let port = idem_e2e::free_port();
    let text = receipts_config(
        &env,
        &format!(
            "[outbox.destinations.receipts]\nkind = \"http\"\nurl = \"http://127.0.0.1:{port}/receipts\"\ntimeout = \"1s\""
        ),
    )
    .replace("max_attempts = 20", "max_attempts = 2");
    let config = Config::from_toml(std::path::Path::new("/tmp/idem-outbox-test.toml"), &text)
        .expect("config");
    let host = env.start_host(config);
    env.publish(&order(1, 1, 100)).await;
    wait_for("the row parked", Duration::from_secs(30), || async {
        env.count("SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    let (attempts, last_error): (i32, String) =
        sqlx::query_as("SELECT attempts, last_error FROM idem_outbox")
            .fetch_one(&env.pool)
            .await
            .expect("outbox row");
    assert_eq!(attempts, 2);
    assert!(
        last_error.contains(&format!("127.0.0.1:{port}")),
        "{last_error}"
    );
    // The message itself applied: the outbox failing never undoes a committed transaction.
    assert_eq!(env.count("SELECT count(*) FROM receipts").await, 1);
    env.cleanup().await;
}

/// An endpoint that redirects every POST (a moved endpoint, a login page) never confirmed a
/// delivery: the 302 is a failed attempt, the row stays pending, nothing follows it to the
/// page it points at.
#[tokio::test]
async fn outbox_does_not_count_a_redirect_as_a_delivery() {
    let env = TestEnv::new("outbox_redirect").await;
    let followed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let router = Router::new()
        .route(
            "/receipts",
            post(|| async {
                (
                    StatusCode::FOUND,
                    [(axum::http::header::LOCATION, "/login")],
                )
            }),
        )
        .route(
            "/login",
            axum::routing::any({
                let followed = Arc::clone(&followed);
                move || async move {
                    followed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    StatusCode::OK
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let text = receipts_config(
        &env,
        &format!(
            "[outbox.destinations.receipts]\nkind = \"http\"\nurl = \"http://127.0.0.1:{port}/receipts\"\ntimeout = \"1s\""
        ),
    );
    let config = Config::from_toml(std::path::Path::new("/tmp/idem-outbox-test.toml"), &text)
        .expect("config");
    let host = env.start_host(config);
    env.publish(&order(1, 1, 100)).await;
    wait_for("a failed attempt", Duration::from_secs(30), || async {
        env.count("SELECT count(*) FROM idem_outbox WHERE attempts >= 1")
            .await
            == 1
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    let (delivered, last_error): (bool, String) = sqlx::query_as(
        "SELECT delivered_at IS NOT NULL, coalesce(last_error, '') FROM idem_outbox",
    )
    .fetch_one(&env.pool)
    .await
    .expect("outbox row");
    assert!(!delivered, "a 302 was counted as a delivery");
    assert!(last_error.contains("302"), "{last_error}");
    assert_eq!(
        followed.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
    env.cleanup().await;
}

/// An https destination trusting only its own CA (`ca_file`), served by an in-process TLS
/// endpoint: every receipt is delivered once with its `Idempotency-Key`, and the first try of
/// every tenth key, answered with a 302, is a failed attempt that a later try delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_delivers_over_https_to_a_private_ca() {
    let env = TestEnv::new("outbox_https").await;
    let directory = std::env::temp_dir().join(format!("{}-pki", env.database));
    let pki = Pki::new(&directory);
    let shared = Shared::default();
    let redirects = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let router = Router::new()
        .route(
            "/receipts",
            post({
                let redirects = Arc::clone(&redirects);
                move |state: State<Shared>, headers: HeaderMap, body: String| async move {
                    // `receive` refuses the first try of every tenth key; here as a redirect.
                    match receive(state, headers, body).await {
                        StatusCode::SERVICE_UNAVAILABLE => {
                            redirects.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            (
                                StatusCode::FOUND,
                                [(axum::http::header::LOCATION, "/login")],
                            )
                                .into_response()
                        }
                        status => status.into_response(),
                    }
                }
            }),
        )
        .with_state(Arc::clone(&shared));
    let (listener, port, handshakes) = HttpsListener::bind(pki.server_config(false)).await;
    tokio::spawn(async move { axum::serve(listener, router).await });
    let text = receipts_config(
        &env,
        &format!(
            "[outbox.destinations.receipts]\nkind = \"http\"\nurl = \"https://localhost:{port}/receipts\"\ntimeout = \"5s\"\nca_file = \"{}\"",
            pki.ca.display()
        ),
    );
    let config = Config::from_toml(&directory.join("pipelines.toml"), &text).expect("config");
    let host = env.start_host(config);
    let receipts = 60;
    for order_id in 1..=receipts {
        env.publish(&order(order_id, order_id % 5, 1_000 + order_id))
            .await;
    }
    wait_for(
        "every receipt delivered",
        Duration::from_secs(60),
        || async {
            env.count("SELECT count(*) FROM idem_outbox WHERE delivered_at IS NOT NULL")
                .await
                == receipts
        },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    let requests = shared.lock().expect("endpoint state").requests.clone();
    let accepted: Vec<&String> = requests
        .iter()
        .filter(|(_, accepted)| *accepted)
        .map(|(key, _)| key)
        .collect();
    let distinct: BTreeSet<&String> = accepted.iter().copied().collect();
    assert_eq!(
        accepted.len(),
        distinct.len(),
        "a receipt was delivered twice"
    );
    assert_eq!(distinct.len(), usize::try_from(receipts).expect("count"));
    assert!(requests.iter().all(|(key, _)| !key.is_empty()));
    let redirected = redirects.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(redirected, u64::try_from(receipts / 10).expect("count"));
    assert_eq!(
        requests.len(),
        accepted.len() + usize::try_from(redirected).expect("count"),
        "a redirect was followed or counted"
    );
    let handshakes = handshakes.lock().expect("handshakes").clone();
    assert!(
        handshakes.iter().all(|handshake| handshake.outcome.is_ok()),
        "{handshakes:?}"
    );
    eprintln!(
        "https outbox: negotiated {:?}",
        handshakes.first().map(|handshake| &handshake.outcome)
    );
    let _ = std::fs::remove_dir_all(&directory);
    env.cleanup().await;
}

/// `idem outbox list --parked` shows a row parked while its endpoint was down; once the
/// endpoint is back, `idem outbox retry` makes it pending again and the running relay
/// delivers it, once.
#[tokio::test]
async fn outbox_retry_sends_a_parked_row_again_once() {
    let env = TestEnv::new("outbox_retry").await;
    let accepting = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let delivered = Arc::new(Mutex::new(Vec::<String>::new()));
    let router = Router::new().route(
        "/receipts",
        post({
            let accepting = Arc::clone(&accepting);
            let delivered = Arc::clone(&delivered);
            move |headers: HeaderMap| async move {
                if !accepting.load(std::sync::atomic::Ordering::SeqCst) {
                    return StatusCode::SERVICE_UNAVAILABLE;
                }
                let key = idem_e2e::idempotency_key(&headers)
                    .unwrap_or_default()
                    .to_string();
                delivered.lock().expect("deliveries").push(key);
                StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind endpoint");
    let port = listener.local_addr().expect("endpoint address").port();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let text = receipts_config(
        &env,
        &format!(
            "[outbox.destinations.receipts]\nkind = \"http\"\nurl = \"http://127.0.0.1:{port}/receipts\"\ntimeout = \"1s\""
        ),
    )
    .replace("max_attempts = 20", "max_attempts = 2");
    let config_path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&config_path, &text).expect("write config");
    let host = env.start_host(Config::from_toml(&config_path, &text).expect("config"));
    env.publish(&order(1, 1, 100)).await;
    env.publish(&order(2, 1, 100)).await;
    wait_for("both rows parked", Duration::from_secs(30), || async {
        env.count("SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL")
            .await
            == 2
    })
    .await;
    let idem = |args: &[&str]| {
        let output = std::process::Command::new(idem_e2e::idem_binary())
            .args(args)
            .arg("--config")
            .arg(&config_path)
            .output()
            .expect("run idem");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    let (listed, table) = idem(&["outbox", "list", "--parked"]);
    assert!(listed, "{table}");
    assert_eq!(table.matches("parked").count(), 2, "{table}");
    assert!(table.contains("503"), "the last error is shown: {table}");
    let first_id: i64 = sqlx::query_scalar("SELECT min(id) FROM idem_outbox")
        .fetch_one(&env.pool)
        .await
        .expect("row id");

    accepting.store(true, std::sync::atomic::Ordering::SeqCst);
    let (retried, said) = idem(&["outbox", "retry", "--id", &first_id.to_string()]);
    assert!(retried, "{said}");
    assert!(said.contains("1 parked row(s) are pending again"), "{said}");
    wait_for(
        "the retried row delivered",
        Duration::from_secs(30),
        || async {
            env.count("SELECT count(*) FROM idem_outbox WHERE delivered_at IS NOT NULL")
                .await
                == 1
        },
    )
    .await;
    // Only the row asked for: the other stays parked until it is retried too.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        env.count("SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL")
            .await,
        1
    );
    let (retried, said) = idem(&["outbox", "retry", "--destination", "receipts"]);
    assert!(retried, "{said}");
    wait_for("both rows delivered", Duration::from_secs(30), || async {
        env.count("SELECT count(*) FROM idem_outbox WHERE delivered_at IS NOT NULL")
            .await
            == 2
    })
    .await;
    let (retried, said) = idem(&["outbox", "retry"]);
    assert!(!retried, "nothing parked is left to retry: {said}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    host.stop().await.expect("host stops cleanly");
    let deliveries = delivered.lock().expect("deliveries").clone();
    assert_eq!(
        deliveries.len(),
        2,
        "each row delivered once: {deliveries:?}"
    );
    assert_ne!(deliveries[0], deliveries[1]);
    let _ = std::fs::remove_file(config_path);
    env.cleanup().await;
}
