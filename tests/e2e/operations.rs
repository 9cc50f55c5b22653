//! Operations: retention, metrics, graceful shutdown, replay, and the operator commands.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem_e2e::{TestEnv, idem_binary, order, spawn_idem, unacked, wait_for};
use idem_host::config::RetentionConfig;
use idem_host::store::retention::{self, Pass};
use idem_host::store::tables::Tables;
use idem_host::telemetry::metrics::Metrics;
use tokio_util::sync::CancellationToken;

/// Batched cleanup removes exactly the claims outside the window, of its own consumer only,
/// while a host keeps claiming new messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_exactly_the_claims_outside_the_window() {
    let env = TestEnv::new("retention").await;
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_key, processed_at) \
         SELECT 'loyalty', 'old:' || n, now() - interval '40 days' - n * interval '1 second' FROM generate_series(1, 5000) n \
         UNION ALL SELECT 'loyalty', 'recent:' || n, now() - interval '29 days' FROM generate_series(1, 3000) n \
         UNION ALL SELECT 'analytics', 'old:' || n, now() - interval '90 days' FROM generate_series(1, 700) n",
    )
    .execute(&env.pool)
    .await
    .expect("seed claims");
    let host = env.start_host(env.config("loyalty", ""));
    let publisher = {
        let queue = env.queue.clone();
        tokio::spawn(async move {
            let (_connection, channel) = idem_e2e::connect_channel().await;
            for order_id in 1..=500 {
                idem_e2e::publish(&channel, &queue, &order(order_id, 1, 100)).await;
            }
        })
    };
    let retention = RetentionConfig {
        window: Duration::from_secs(30 * 86_400),
        batch_size: std::num::NonZeroU32::new(700).expect("non-zero"),
        pause: Duration::from_millis(5),
        every: Duration::ZERO,
    };
    let metrics = Metrics::new();
    let pass = retention::clean_all(
        &env.pool,
        &Tables::default(),
        &[("loyalty".into(), "loyalty".into(), retention)],
        Some(&metrics),
        &CancellationToken::new(),
    )
    .await
    .expect("cleanup runs");
    publisher.await.expect("publisher");
    wait_for("500 new claims", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 500
    })
    .await;
    host.stop().await.expect("host stops");

    let Pass::Cleaned(deleted) = pass else {
        panic!("the cleaning lock was busy");
    };
    assert_eq!(deleted.get("loyalty"), Some(&5000));
    assert_eq!(env.count("SELECT count(*) FROM processed_messages WHERE message_key LIKE 'old:%' AND consumer = 'loyalty'").await, 0);
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages WHERE message_key LIKE 'recent:%'")
            .await,
        3000
    );
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages WHERE consumer = 'analytics'")
            .await,
        700
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM processed_messages WHERE message_key LIKE 'order-completed:%'"
        )
        .await,
        500
    );
    assert!(
        metrics
            .encode()
            .contains(r#"idem_claims_deleted_total{pipeline="loyalty"} 5000"#)
    );

    // A second host cannot clean while one holds the lock; nor while an older host (before
    // tables in a schema of their own) holds its constant key: in a rolling upgrade, the two
    // never clean at once.
    for lock in [
        "SELECT pg_advisory_lock(hashtextextended('idem-retention ' || current_schema(), 0))",
        "SELECT pg_advisory_lock(x'1de3000000000001'::int8)",
    ] {
        let mut holder = env.pool.acquire().await.expect("connection");
        sqlx::query(lock)
            .execute(&mut *holder)
            .await
            .expect("take a cleaning lock");
        let busy = retention::clean_all(
            &env.pool,
            &Tables::default(),
            &[],
            None,
            &CancellationToken::new(),
        )
        .await
        .expect("cleanup runs");
        assert_eq!(busy, Pass::Busy, "{lock}");
        // A pooled connection keeps a session's locks: release it before the next.
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *holder)
            .await
            .expect("release the cleaning lock");
    }
    env.cleanup().await;
}

/// The duplicate counter equals the duplicate deliveries of a run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_every_duplicate_delivery() {
    let env = TestEnv::new("dupmetric").await;
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(env.config("loyalty", ""), Arc::clone(&metrics));
    for order_id in 1..=300 {
        env.publish(&order(order_id, order_id % 7, 500)).await;
    }
    for order_id in (1..=300).step_by(3) {
        env.publish(&order(order_id, order_id % 7, 500)).await;
    }
    env.publish(b"not json").await;
    wait_for("400 settled messages", Duration::from_secs(60), || async {
        metrics.messages("loyalty", "applied")
            + metrics.messages("loyalty", "duplicate")
            + metrics.messages("loyalty", "rejected")
            == 401
    })
    .await;
    host.stop().await.expect("host stops");
    assert_eq!(metrics.messages("loyalty", "applied"), 300);
    assert_eq!(metrics.messages("loyalty", "duplicate"), 100);
    assert_eq!(metrics.messages("loyalty", "rejected"), 1);
    let text = metrics.encode();
    assert!(
        text.contains(r#"idem_messages_total{pipeline="loyalty",outcome="duplicate"} 100"#),
        "{text}"
    );
    env.cleanup().await;
}

/// SIGTERM in the middle of a 5,000-message run: exit 0 with nothing half-done; a restart
/// finishes the run with every order credited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_a_restart_completes_the_run() {
    let env = TestEnv::new("sigterm").await;
    let config_path = env.write_config("loyalty", "");
    for order_id in 1..=5000 {
        env.publish(&order(order_id, order_id % 25, 1000 + order_id))
            .await;
    }
    let child = spawn_idem(&config_path, &[]);
    wait_for("1,000 credits", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await >= 1000
    })
    .await;
    let status = tokio::task::spawn_blocking(move || child.terminate())
        .await
        .expect("join");
    assert_eq!(
        status.code(),
        Some(0),
        "idem should exit 0 on SIGTERM, got {status}"
    );
    let credited = env.count("SELECT count(*) FROM point_ledger").await;
    assert!(
        credited < 5000,
        "the run finished before SIGTERM; nothing was tested"
    );
    env.assert_loyalty_consistent().await;
    assert_eq!(
        env.count("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND datname = current_database()")
            .await,
        0
    );

    let host = env.start_host(env.config("loyalty", ""));
    wait_for("5,000 credits", Duration::from_secs(120), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 5000
    })
    .await;
    wait_for("the queue to drain", Duration::from_secs(60), || async {
        env.ready(&env.queue).await == 0 && unacked(&env.queue) == 0
    })
    .await;
    host.stop().await.expect("host stops");
    env.assert_loyalty_consistent().await;
    let _ = std::fs::remove_file(config_path);
    env.cleanup().await;
}

/// `idem replay` of 100 dead letters, half of which had been applied by an earlier delivery,
/// credits only the other half.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_credits_only_what_was_never_applied() {
    let env = TestEnv::new("replay").await;
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(env.config("loyalty", ""), Arc::clone(&metrics));
    for order_id in 1..=50 {
        env.publish(&order(order_id, 3, 1000)).await;
    }
    wait_for("50 credits", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 50
    })
    .await;
    // 100 dead letters: orders 1..=50 again (already applied) and 51..=100 (never applied).
    for order_id in 1..=100 {
        idem_e2e::publish(
            &env.channel,
            &env.dead_letter_queue,
            &order(order_id, 3, 1000),
        )
        .await;
    }
    let config_path = env.write_config("loyalty", "");
    let output = Command::new(idem_binary())
        .args(["replay", "--pipeline", "loyalty", "--config"])
        .arg(&config_path)
        .stderr(Stdio::inherit())
        .output()
        .expect("idem replay");
    assert!(output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("replayed 100 message(s)"),
        "{output:?}"
    );
    wait_for("100 credits", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 100
    })
    .await;
    wait_for("50 duplicates", Duration::from_secs(30), || async {
        metrics.messages("loyalty", "duplicate") == 50
    })
    .await;
    host.stop().await.expect("host stops");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0);
    assert_eq!(
        env.count("SELECT points FROM balances WHERE customer_id = 3")
            .await,
        100 * 10
    );
    env.assert_loyalty_consistent().await;
    let _ = std::fs::remove_file(config_path);
    env.cleanup().await;
}

/// `idem try` prints the plugin's decision; `idem check` lists every problem at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_and_check_report_clearly() {
    let env = TestEnv::new("cli").await;
    let config_path = env.write_config("loyalty", "");
    let message = std::env::temp_dir().join(format!("{}-order.json", env.database));
    std::fs::write(&message, order(9912, 7, 5000)).expect("message file");
    let tried = Command::new(idem_binary())
        .args(["try", "--pipeline", "loyalty", "--config"])
        .arg(&config_path)
        .arg("--message")
        .arg(&message)
        .output()
        .expect("idem try");
    assert!(tried.status.success(), "{tried:?}");
    let decision: serde_json::Value = serde_json::from_slice(&tried.stdout).expect("JSON decision");
    assert_eq!(decision["outcome"], "decision");
    assert_eq!(decision["key"], "order-completed:9912");
    assert_eq!(decision["effects"][0][0], "credit_balance");
    assert_eq!(decision["effects"][0][1][1], 50);

    // Three separate problems: a missing plugin, a statement that does not prepare, and a
    // parameter type idem cannot bind.
    let broken = env
        .config_text("loyalty", "")
        .replace("loyalty.wasm", "missing.wasm")
        .replace("INSERT INTO point_ledger", "INSERT INTO no_such_table")
        .replace(
            "[pipelines.loyalty.statements]",
            "[pipelines.loyalty.statements]\nround = \"SELECT round($1::numeric)\"",
        );
    let broken_path = std::env::temp_dir().join(format!("{}-broken.toml", env.database));
    std::fs::write(&broken_path, broken).expect("write config");
    let checked = Command::new(idem_binary())
        .args(["check", "--config"])
        .arg(&broken_path)
        .output()
        .expect("idem check");
    let report = String::from_utf8_lossy(&checked.stdout);
    assert_eq!(checked.status.code(), Some(5), "{report}");
    assert!(report.contains("missing.wasm"), "{report}");
    assert!(
        report.contains("record_ledger") && report.contains("no_such_table"),
        "{report}"
    );
    assert!(
        report.contains("round") && report.contains("numeric"),
        "{report}"
    );
    assert!(report.contains("3 problem(s) found"), "{report}");

    for path in [config_path, broken_path, message] {
        let _ = std::fs::remove_file(path);
    }
    env.cleanup().await;
}

/// Partition mode: converting keeps every claim, maintenance drops only the partitions wholly
/// older than the window, and claims still deduplicate across partitions and concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_mode_drops_old_days_and_still_deduplicates() {
    use idem_host::message::InboundMessage;
    use idem_host::pipeline::process::{Disposition, Settled, handle_delivery};
    use idem_host::store::partition;

    let env = TestEnv::new("partition").await;
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_key, processed_at) \
         SELECT 'loyalty', 'd45:' || n, now() - interval '45 days' FROM generate_series(1, 100) n \
         UNION ALL SELECT 'loyalty', 'd31:' || n, now() - interval '31 days' FROM generate_series(1, 100) n \
         UNION ALL SELECT 'loyalty', 'd29:' || n, now() - interval '29 days' FROM generate_series(1, 100) n \
         UNION ALL SELECT 'loyalty', 'order-completed:1', now() - interval '3 days'",
    )
    .execute(&env.pool)
    .await
    .expect("seed claims");

    assert_eq!(
        partition::convert(&env.pool, &Tables::default())
            .await
            .expect("convert"),
        partition::Conversion::Converted
    );
    assert!(
        partition::is_partitioned(&env.pool, &Tables::default())
            .await
            .expect("inspect")
    );
    assert_eq!(
        partition::convert(&env.pool, &Tables::default())
            .await
            .expect("second convert is a no-op"),
        partition::Conversion::AlreadyPartitioned
    );
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages").await,
        301
    );

    let maintenance = partition::maintain(
        &env.pool,
        &Tables::default(),
        Duration::from_secs(30 * 86_400),
    )
    .await
    .expect("maintain");
    assert!(maintenance.dropped.len() >= 2, "{maintenance:?}");
    assert_eq!(maintenance.stray_rows, 0);
    assert_eq!(env.count("SELECT count(*) FROM processed_messages WHERE message_key LIKE 'd45:%' OR message_key LIKE 'd31:%'").await, 0);
    assert_eq!(
        env.count("SELECT count(*) FROM processed_messages WHERE message_key LIKE 'd29:%'")
            .await,
        100
    );
    let today = format!("processed_messages_p{}", chrono_today());
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM pg_class WHERE relname = '{today}'"
        ))
        .await,
        1
    );

    let pipeline = std::sync::Arc::new(env.pipeline("loyalty", "").await);
    assert!(pipeline.partitioned_claims());
    let shutdown = CancellationToken::new();
    let message = |order_id| InboundMessage {
        pipeline: "loyalty".into(),
        body: order(order_id, 4, 900),
        ..InboundMessage::default()
    };
    // Claimed three days ago, in another partition: still a duplicate.
    assert_eq!(
        handle_delivery(&pipeline, &message(1), 1, &shutdown).await,
        Disposition::Ack(Settled::Duplicate)
    );
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let pipeline = std::sync::Arc::clone(&pipeline);
        let shutdown = shutdown.clone();
        let delivery = message(2);
        tasks.push(tokio::spawn(async move {
            handle_delivery(&pipeline, &delivery, 1, &shutdown).await
        }));
    }
    let mut applied = 0;
    for task in tasks {
        if task.await.expect("task") == Disposition::Ack(Settled::Applied) {
            applied += 1;
        }
    }
    assert_eq!(applied, 1);
    assert_eq!(env.count("SELECT count(*) FROM point_ledger").await, 1);
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM \"{today}\" WHERE message_key = 'order-completed:2'"
        ))
        .await,
        1
    );
    env.cleanup().await;
}

/// Two consumers share a partitioned `processed_messages` with windows of 1 and 30 days: a
/// host that knows only the 1-day consumer must not drop the other's claims younger than 30
/// days. And `idem partition` refuses while a host is connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_retention_keeps_every_consumers_window() {
    use idem_host::store::partition;
    use idem_host::store::retention;

    let env = TestEnv::new("partition_windows").await;
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_key, processed_at) \
         SELECT c, d || ':' || n, now() - make_interval(days => d) \
         FROM unnest(ARRAY['short', 'long']) c, unnest(ARRAY[2, 10, 29, 31, 45]) d, generate_series(1, 10) n",
    )
    .execute(&env.pool)
    .await
    .expect("seed claims");

    // A host is connected (application_name = idem): the conversion is refused.
    let host_session = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            env.database_url
                .parse::<sqlx::postgres::PgConnectOptions>()
                .expect("url")
                .application_name("idem"),
        )
        .await
        .expect("host session");
    sqlx::query("SELECT 1")
        .execute(&host_session)
        .await
        .expect("session up");
    assert_eq!(
        partition::convert(&env.pool, &Tables::default())
            .await
            .expect("convert"),
        partition::Conversion::HostsConnected { sessions: 1 }
    );
    assert!(
        !partition::is_partitioned(&env.pool, &Tables::default())
            .await
            .expect("inspect")
    );
    host_session.close().await;
    // The server lists a closed session until its backend has exited: a moment later.
    wait_for(
        "the conversion once the host is gone",
        Duration::from_secs(10),
        || async {
            partition::convert(&env.pool, &Tables::default())
                .await
                .expect("convert")
                == partition::Conversion::Converted
        },
    )
    .await;

    // The 30-day consumer's host recorded its window; this host knows only the 1-day one.
    retention::record_windows(
        &env.pool,
        &Tables::default(),
        [("long", Duration::from_secs(30 * 86_400))],
    )
    .await
    .expect("record the long window");
    retention::record_windows(
        &env.pool,
        &Tables::default(),
        [("short", Duration::from_secs(86_400))],
    )
    .await
    .expect("record the short window");
    let maintenance =
        partition::maintain(&env.pool, &Tables::default(), Duration::from_secs(86_400))
            .await
            .expect("maintain");
    assert!(!maintenance.dropped.is_empty(), "{maintenance:?}");
    let young = env
        .count("SELECT count(*) FROM processed_messages WHERE processed_at > now() - interval '30 days'")
        .await;
    assert_eq!(
        young,
        2 * 3 * 10,
        "a claim younger than 30 days was dropped"
    );
    let old = env
        .count("SELECT count(*) FROM processed_messages WHERE processed_at < now() - interval '31 days'")
        .await;
    assert_eq!(old, 0, "claims past every window are dropped");
    env.cleanup().await;
}

fn chrono_today() -> String {
    let output = Command::new("date")
        .args(["-u", "+%Y%m%d"])
        .output()
        .expect("date");
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// `idem wit` hands out the contract the binary was built with: printed, it is the
/// repository's `wit/world.wit` byte for byte; with `--out DIR` it is written as a WIT package
/// directory (`DIR/world.wit`, the directory created), for a plugin project outside the
/// repository.
#[test]
fn wit_prints_and_writes_the_contract_the_host_was_built_with() {
    let expected =
        std::fs::read_to_string(std::path::Path::new(idem_e2e::REPO_ROOT).join("wit/world.wit"))
            .expect("wit/world.wit");
    assert!(expected.contains("package idem:plugin@"), "{expected}");
    let printed = Command::new(idem_binary())
        .arg("wit")
        .output()
        .expect("run idem wit");
    assert!(printed.status.success(), "idem wit failed: {printed:?}");
    assert_eq!(String::from_utf8_lossy(&printed.stdout), expected);

    let directory = std::env::temp_dir().join(format!("idem-wit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    let out = directory.join("project/wit");
    let written = Command::new(idem_binary())
        .arg("wit")
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run idem wit --out");
    assert!(
        written.status.success(),
        "idem wit --out failed: {written:?}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("world.wit")).expect("world.wit written"),
        expected
    );
    let _ = std::fs::remove_dir_all(&directory);
}

/// `cargo install --path host` gives a binary that needs nothing from the checkout: the
/// installed `idem migrate` creates the host's tables in a fresh database and the installed
/// `idem run` credits orders there. (`--debug` and the workspace's target directory only
/// reuse this build's artifacts; the install is the one a user runs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cargo_install_gives_a_binary_that_migrates_and_runs() {
    use sqlx::Connection;
    let env = TestEnv::new("install").await;
    let root = std::env::temp_dir().join(format!("idem-install-{}", env.database));
    let repo = std::path::Path::new(idem_e2e::REPO_ROOT);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let installed = Command::new(cargo)
        .args(["install", "--locked", "--debug", "--quiet", "--path"])
        .arg(repo.join("host"))
        .arg("--root")
        .arg(&root)
        .arg("--target-dir")
        .arg(repo.join("target"))
        .output()
        .expect("cargo install");
    assert!(
        installed.status.success(),
        "{}",
        String::from_utf8_lossy(&installed.stderr)
    );
    let binary = root.join("bin/idem");
    assert!(binary.is_file());

    // A database with the business schema only: the installed binary brings the host's.
    let fresh = format!("{}_fresh", env.database);
    let mut admin = sqlx::PgConnection::connect(&idem_e2e::admin_url())
        .await
        .expect("admin connection");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{fresh}\"")))
        .execute(&mut admin)
        .await
        .expect("create database");
    let fresh_url = env.database_url.replace(&env.database, &fresh);
    let mut connection = sqlx::PgConnection::connect(&fresh_url)
        .await
        .expect("fresh database");
    sqlx::raw_sql(sqlx::AssertSqlSafe(
        std::fs::read_to_string(repo.join("examples/loyalty/schema.sql"))
            .expect("schema")
            .to_string(),
    ))
    .execute(&mut connection)
    .await
    .expect("business schema");
    let config_path = root.join("pipelines.toml");
    std::fs::write(
        &config_path,
        env.config_text("loyalty", "")
            .replace(&env.database, &fresh),
    )
    .expect("config");

    let migrated = Command::new(&binary)
        .args(["migrate", "--config"])
        .arg(&config_path)
        .output()
        .expect("idem migrate");
    assert!(migrated.status.success(), "{migrated:?}");
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_messages")
        .fetch_one(&mut connection)
        .await
        .expect("processed_messages exists after idem migrate");
    assert_eq!(claims, 0);

    let child = idem_e2e::IdemProcess::spawn(
        Command::new(&binary)
            .args(["run", "--config"])
            .arg(&config_path)
            .stdin(Stdio::null()),
    );
    for order_id in 1..=20 {
        env.publish(&order(order_id, 4, 1000)).await;
    }
    let ledger = || {
        let url = fresh_url.clone();
        async move {
            let mut connection = sqlx::PgConnection::connect(&url).await.expect("connect");
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM point_ledger")
                .fetch_one(&mut connection)
                .await
                .expect("count")
        }
    };
    wait_for(
        "20 credits by the installed binary",
        Duration::from_secs(60),
        || async { ledger().await == 20 },
    )
    .await;
    let status = tokio::task::spawn_blocking(move || child.terminate())
        .await
        .expect("join");
    assert_eq!(status.code(), Some(0));
    drop(connection);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{fresh}\" WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    .expect("drop database");
    let _ = std::fs::remove_dir_all(&root);
    env.cleanup().await;
}

/// `idem completions` prints a script for the shell that knows the subcommands, and
/// `idem schema` a JSON Schema of pipelines.toml that refuses unknown keys.
#[test]
fn completions_and_schema_are_printed() {
    let run = |args: &[&str]| {
        let output = Command::new(idem_binary())
            .args(args)
            .output()
            .expect("run idem");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).expect("UTF-8")
    };
    let bash = run(&["completions", "bash"]);
    for word in [
        "_idem()",
        "dlq",
        "outbox",
        "new",
        "build",
        "test",
        "--dry-run",
    ] {
        assert!(
            bash.contains(word),
            "{word} missing from the bash completions"
        );
    }
    assert!(run(&["completions", "zsh"]).contains("#compdef idem"));
    let schema: serde_json::Value =
        serde_json::from_str(&run(&["schema"])).expect("the schema is JSON");
    assert_eq!(schema["title"], "pipelines.toml");
    assert_eq!(schema["additionalProperties"], false);
    assert!(schema["$defs"]["RawPipeline"]["properties"]["cases"].is_object());
}

/// A `processed_messages` that is not idem's (a hand-written consumer's, by the guide's name)
/// is not adopted: `idem migrate` changes nothing and says which columns and key differ, and
/// `idem run` and `idem check` refuse it the same way. A table of the guide's own shape is
/// adopted (the digest column added).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processed_messages_of_another_shape_is_refused_not_adopted() {
    let env = TestEnv::new("foreign_claims").await;
    let foreign = format!("{}_foreign", env.database);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE \"{foreign}\""
    )))
    .execute(&env.pool)
    .await
    .expect("create database");
    let foreign_url = env.database_url.replace(&env.database, &foreign);
    let pool = sqlx::PgPool::connect(&foreign_url).await.expect("connect");
    sqlx::raw_sql(
        "CREATE TABLE processed_messages (message_id text PRIMARY KEY, \
         processed_at timestamptz NOT NULL, handler text NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("a consumer's own table");
    let text = env.config_text_at(&foreign_url, "loyalty", "");
    let path = std::env::temp_dir().join(format!("{foreign}.toml"));
    std::fs::write(&path, &text).expect("config");
    let output = idem_e2e::must_refuse("migrate", &path);
    for fragment in [
        "processed_messages table",
        "no column consumer (text)",
        "no column message_key (text)",
        "column handler is NOT NULL without a default",
        "no unique key on (consumer, message_key) (unique keys: (message_id))",
    ] {
        assert!(output.contains(fragment), "{fragment:?} missing: {output}");
    }
    let untouched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns \
         WHERE table_name = 'processed_messages' AND column_name = 'plugin_digest'",
    )
    .fetch_one(&pool)
    .await
    .expect("columns");
    assert_eq!(untouched, 0, "the refused migration changed the table");
    idem_e2e::run_and_check_refuse(&path, "not the claims table idem needs", "foreign table");

    // The guide's own table: the same claims, adopted.
    sqlx::raw_sql(
        "DROP TABLE processed_messages; \
         CREATE TABLE processed_messages (consumer text NOT NULL, message_key text NOT NULL, \
         processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer, message_key))",
    )
    .execute(&pool)
    .await
    .expect("the guide's table");
    idem_e2e::must_succeed("migrate", &path);
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{foreign}\" WITH (FORCE)"
    )))
    .execute(&env.pool)
    .await
    .expect("drop database");
    env.cleanup().await;
}
