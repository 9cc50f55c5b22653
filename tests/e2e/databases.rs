//! Pipelines whose effects live in different databases (`[databases.<name>]`, `database =
//! "<name>"`): each database keeps its own claims, outbox and migrations, and `idem migrate`,
//! `check`, `status` and `cleanup` cover every one.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use idem_e2e::{
    TestEnv, admin_url, count, create_database, must_succeed, order, pipeline_table, plugin_path,
    wait_for,
};
use idem_host::config::Config;

/// The idempotency keys an HTTP endpoint received.
type Received = Arc<Mutex<BTreeSet<String>>>;

async fn receive(State(received): State<Received>, headers: HeaderMap) -> StatusCode {
    if let Some(key) = idem_e2e::idempotency_key(&headers) {
        received.lock().expect("keys").insert(key.to_string());
    }
    StatusCode::OK
}

async fn endpoint() -> (u16, Received) {
    let received = Received::default();
    let router = Router::new()
        .route("/receipts", post(receive))
        .with_state(Arc::clone(&received));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind endpoint");
    let port = listener.local_addr().expect("endpoint address").port();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (port, received)
}

/// The loyalty pipeline in `[database]`, the receipts pipeline (with outbox rows to an HTTP
/// endpoint) in `[databases.billing]`: every order once in its own database, each database's
/// claims and outbox rows its pipeline's alone, the billing relay delivering every receipt;
/// the commands report both databases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelines_in_two_databases_keep_their_own_claims_and_outbox() {
    let env = TestEnv::new("two_databases").await;
    let billing_name = format!("{}_billing", env.database);
    let (billing_url, billing) = create_database(&admin_url(), &billing_name).await;
    let (receipts_queue, receipts_dead_letters) = env.extra_queues("receipts").await;
    let (port, received) = endpoint().await;
    let text = format!(
        r#"{header}
[databases.billing]
url = "{billing_url}"
max_connections = 8

[outbox]
poll = "50ms"

[outbox.destinations.receipts]
kind = "http"
url = "http://127.0.0.1:{port}/receipts"
timeout = "5s"
{loyalty}

[pipelines.receipts]
database = "billing"
queue = "{receipts_queue}"
plugin = "{receipts_plugin}"
dead_letter_queue = "{receipts_dead_letters}"

[pipelines.receipts.statements]
record_receipt = "INSERT INTO receipts (order_id, customer_id, total_cents) VALUES ($1, $2, $3)"
"#,
        header = env.config_header(),
        loyalty = pipeline_table(
            "loyalty",
            &env.queue,
            &env.dead_letter_queue,
            &plugin_path("loyalty"),
            ""
        ),
        receipts_plugin = plugin_path("receipts").display(),
    );
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, &text).expect("config");

    let migrated = must_succeed("migrate", &path);
    for database in ["[database]", "[databases.billing]"] {
        assert!(
            migrated.contains(&format!("{database}: migrations applied (0 new)")),
            "{database}: {migrated}"
        );
    }
    let checked = must_succeed("check", &path);
    assert!(
        checked.contains("ok   [databases.billing]: idem's tables in"),
        "{checked}"
    );

    let host = env.start_host(Config::from_toml(&path, &text).expect("config"));
    let channel = env.live_channel().await;
    for order_id in 1..=60 {
        env.publish(&order(order_id, order_id % 7, 100 + order_id))
            .await;
    }
    for order_id in 1..=40 {
        let body = order(order_id, order_id % 5, 1_000 + order_id);
        idem_e2e::publish(&channel, &receipts_queue, &body).await;
        if order_id % 4 == 0 {
            idem_e2e::publish(&channel, &receipts_queue, &body).await;
        }
    }
    wait_for(
        "every order and receipt",
        Duration::from_secs(60),
        || async {
            count(&env.pool, "SELECT count(*) FROM point_ledger").await == 60
                && count(&billing, "SELECT count(*) FROM receipts").await == 40
                && received.lock().expect("keys").len() == 40
        },
    )
    .await;
    wait_for("the queues drained", Duration::from_secs(30), || async {
        env.ready(&env.queue).await == 0 && env.ready(&receipts_queue).await == 0
    })
    .await;

    let status = must_succeed("status", &path);
    assert!(
        status.contains("database      [databases.billing]")
            && status.contains("outbox of [databases.billing]: 0 pending"),
        "{status}"
    );
    host.stop().await.expect("host stops cleanly");
    for queue in [&env.dead_letter_queue, &receipts_dead_letters] {
        assert_eq!(env.ready(queue).await, 0, "dead letters in {queue}");
    }
    let claims = "SELECT count(*) FROM processed_messages WHERE consumer = ";
    assert_eq!(count(&env.pool, &format!("{claims}'loyalty'")).await, 60);
    assert_eq!(count(&env.pool, &format!("{claims}'receipts'")).await, 0);
    assert_eq!(count(&billing, &format!("{claims}'receipts'")).await, 40);
    assert_eq!(count(&billing, &format!("{claims}'loyalty'")).await, 0);
    assert_eq!(
        count(&env.pool, "SELECT count(*) FROM idem_outbox").await,
        0
    );
    assert_eq!(
        count(
            &billing,
            "SELECT count(*) FROM idem_outbox WHERE delivered_at IS NOT NULL"
        )
        .await,
        40
    );
    assert_eq!(
        count(&billing, "SELECT count(*) FROM point_ledger").await,
        0
    );
    let cleaned = must_succeed("cleanup", &path);
    assert!(
        cleaned.contains("[databases.billing]: consumer \"receipts\": 0 claims deleted"),
        "{cleaned}"
    );

    billing.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{billing_name}\" WITH (FORCE)"
    )))
    .execute(&env.pool)
    .await
    .expect("drop database");
    env.cleanup().await;
}
