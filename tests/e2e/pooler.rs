//! idem behind PgBouncer (Debian's, with the settings it ships), started by each test: in
//! transaction pooling (`[database] pooling = "transaction"`) and session pooling, a startup
//! parameter the pooler refuses, and named statements behind transaction pooling.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idem_e2e::pgbouncer::PgBouncer;
use idem_e2e::{TestEnv, must_refuse, must_succeed, order, run_and_check_refuse, wait_for};
use idem_host::config::Config;
use idem_host::store::retention::{self, Pass};
use idem_host::telemetry::metrics::Metrics;

/// `env`'s config with `[database] url` through `bouncer` and `database_keys` added to the
/// `[database]` table; `extra` goes into the pipeline's table.
fn behind(env: &TestEnv, bouncer: &PgBouncer, database_keys: &str, extra: &str) -> String {
    env.config_text_at(&bouncer.url(&env.database), "loyalty", extra)
        .replacen("[database]\n", &format!("[database]\n{database_keys}"), 1)
}

fn write(env: &TestEnv, name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("{}-{name}.toml", env.database));
    std::fs::write(&path, text).expect("write config");
    path
}

/// Publishes orders `ids`, each once, and every fifth once more (a redelivery).
async fn publish_with_duplicates(env: &TestEnv, ids: std::ops::RangeInclusive<i64>) {
    for order_id in ids {
        let body = order(order_id, order_id % 25, 100 + (order_id * 37) % 10_000);
        env.publish(&body).await;
        if order_id % 5 == 0 {
            env.publish(&body).await;
        }
    }
}

/// Transaction pooling with three server connections for every client: `idem migrate` (twice,
/// on a fresh database, into a schema of idem's own), `idem check`, two hosts applying 1,000
/// orders with 200 redeliveries in batches of 16, and two retention passes. Every order
/// once, nothing dead-lettered, and the second migration finds its history complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_runs_behind_pgbouncer_in_transaction_pooling() {
    let env = TestEnv::new("pooler_transaction").await;
    let bouncer = PgBouncer::start(&env.database, "transaction", 3);
    let pooling = "pooling = \"transaction\"\n";

    // A fresh database migrated through the pooler, twice (the second finds nothing to do).
    let fresh = format!("{}_fresh", env.database);
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{fresh}\"")))
        .execute(&env.pool)
        .await
        .expect("create database");
    let fresh_text = behind(&env, &bouncer, &format!("{pooling}schema = \"idem\"\n"), "")
        .replace(&bouncer.url(&env.database), &bouncer.url(&fresh));
    let fresh_config = write(&env, "fresh", &fresh_text);
    must_succeed("migrate", &fresh_config);
    let again = must_succeed("migrate", &fresh_config);
    assert!(again.contains("(0 new) in schema \"idem\""), "{again}");
    let direct = sqlx::PgPool::connect(&env.database_url.replace(&env.database, &fresh))
        .await
        .expect("fresh database");
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.idem_migrations")
        .fetch_one(&direct)
        .await
        .expect("history");
    assert_eq!(
        versions as usize,
        idem_host::store::database::MIGRATOR.iter().count()
    );
    direct.close().await;

    let text = behind(
        &env,
        &bouncer,
        pooling,
        "[pipelines.loyalty.batch]\nsize = 16",
    );
    let path = write(&env, "transaction", &text);
    let checked = must_succeed("check", &path);
    assert!(checked.contains("statements prepare"), "{checked}");
    let config = Config::from_toml(&path, &text).expect("config");
    let hosts = [
        env.start_host(config.clone()),
        env.start_host(config.clone()),
    ];
    publish_with_duplicates(&env, 1..=1_000).await;
    wait_for("1,000 ledger rows", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 1_000
    })
    .await;
    wait_for("the queue drained", Duration::from_secs(30), || async {
        env.ready(&env.queue).await == 0 && idem_e2e::unacked(&env.queue) == 0
    })
    .await;
    for host in hosts {
        host.stop().await.expect("host stops cleanly");
    }
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    env.assert_loyalty_consistent().await;

    // Retention's lock lives in a transaction: each pass finds it free again.
    let database = idem_host::store::database::open(&config.database)
        .await
        .expect("through the pooler");
    let pipelines = [(
        "loyalty".to_string(),
        "loyalty".to_string(),
        config.pipelines[0].retention.clone(),
    )];
    let never = tokio_util::sync::CancellationToken::new();
    for pass in 1..=2 {
        let outcome =
            retention::clean_all(&database.pool, &database.tables, &pipelines, None, &never)
                .await
                .expect("retention pass");
        assert!(
            matches!(outcome, Pass::Cleaned(_)),
            "pass {pass}: {outcome:?}"
        );
    }
    database.pool.close().await;
    database.sessions.close_idle();
    drop(bouncer);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{fresh}\" WITH (FORCE)"
    )))
    .execute(&env.pool)
    .await
    .expect("drop database");
    env.cleanup().await;
}

/// Session pooling with every setting at its default: idem sends no startup parameter the
/// pooler refuses (it sent `options` before), and keeps its prepared statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_runs_behind_pgbouncer_in_session_pooling() {
    let env = TestEnv::new("pooler_session").await;
    let bouncer = PgBouncer::start(&env.database, "session", 20);
    let text = behind(&env, &bouncer, "", "");
    let path = write(&env, "session", &text);
    must_succeed("check", &path);
    let host = env.start_host(Config::from_toml(&path, &text).expect("config"));
    publish_with_duplicates(&env, 1..=300).await;
    wait_for("300 ledger rows", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 300
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    env.assert_loyalty_consistent().await;
    drop(bouncer);
    env.cleanup().await;
}

/// A startup parameter the pooler refuses (`options` in the URL) is the configuration's
/// fault: `idem run`, `idem check` and `idem migrate` stop at once naming the URL's
/// parameters, instead of retrying forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_startup_parameter_the_pooler_refuses_stops_idem() {
    let env = TestEnv::new("pooler_refused").await;
    let bouncer = PgBouncer::start(&env.database, "transaction", 2);
    let text = behind(&env, &bouncer, "pooling = \"transaction\"\n", "").replace(
        "?sslmode=disable",
        "?sslmode=disable&options=-c%20statement_timeout%3D5000",
    );
    assert!(text.contains("options="), "{text}");
    let path = write(&env, "refused", &text);
    run_and_check_refuse(&path, "parameters of [database] url", "startup parameter");
    let output = must_refuse("migrate", &path);
    assert!(output.contains("parameters of [database] url"), "{output}");
    drop(bouncer);
    env.cleanup().await;
}

/// Behind transaction pooling without `pooling = "transaction"`, a session's named statement
/// is missing on the server connection the pooler lends next: the pipeline pauses naming the
/// setting, and nothing is lost, doubled or dead-lettered meanwhile. The test keeps one of
/// the two server connections in a transaction of its own, in turn, so each idem session
/// meets the other one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_statements_behind_transaction_pooling_pause_naming_the_setting() {
    let env = TestEnv::new("pooler_named").await;
    let bouncer = PgBouncer::start(&env.database, "transaction", 2);
    let port = idem_e2e::free_port();
    let text = format!(
        "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\n",
        behind(&env, &bouncer, "", "")
    );
    let config = Config::from_toml(Path::new("/tmp/pooler-named.toml"), &text).expect("config");
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    let pinning = tokio::spawn(pin_server_connections(bouncer.url(&env.database)));
    publish_with_duplicates(&env, 1..=300).await;
    wait_for("the pipeline to pause", Duration::from_secs(60), || async {
        metrics.is_paused("loyalty") == 1
    })
    .await;
    pinning.abort();
    let (status, body) = idem_e2e::http_request(port, "GET", "/readyz", None).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("[database] pooling"), "{body}");
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    env.assert_loyalty_consistent().await;
    drop(bouncer);
    env.cleanup().await;
}

/// Holds a transaction open on one server connection of the pooler, then on another, in turn,
/// so the pooler lends each client a different server connection from one transaction to the
/// next.
async fn pin_server_connections(url: String) {
    use sqlx::{ConnectOptions, Executor};
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
    let mut holders = Vec::new();
    for _ in 0..2 {
        // Only startup parameters the pooler passes on.
        let connection = options
            .clone()
            .extra_float_digits(None)
            .connect()
            .await
            .expect("through the pooler");
        holders.push(connection);
    }
    for turn in 0.. {
        let holder = &mut holders[turn % 2];
        if holder.execute("BEGIN; SELECT 1").await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        if holder.execute("COMMIT").await.is_err() {
            return;
        }
    }
}
