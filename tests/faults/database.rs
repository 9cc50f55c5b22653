//! Database faults that are never the message's fault: a read-only window (a failover to a
//! node not yet primary), cancelled queries, half-open connections, cached plans outdated by
//! an `ALTER`, and a revoked grant (a configuration fault, which pauses the pipeline). Each
//! ends with the total-queue check: nothing dead-lettered, every order applied once.

use super::*;

/// A server setting changed with `ALTER SYSTEM` for one scenario, reset when dropped, even
/// when the scenario fails.
struct SystemSetting {
    name: &'static str,
}

impl SystemSetting {
    fn set(name: &'static str, value: &str) -> SystemSetting {
        psql(&[
            &format!("ALTER SYSTEM SET {name} = '{value}'"),
            "SELECT pg_reload_conf()",
        ]);
        SystemSetting { name }
    }
}

impl Drop for SystemSetting {
    fn drop(&mut self) {
        psql(&[
            "SET default_transaction_read_only = off",
            &format!("ALTER SYSTEM RESET {}", self.name),
            "SELECT pg_reload_conf()",
        ]);
    }
}

/// Runs `commands` in one `psql` session as the administrator.
fn psql(commands: &[&str]) {
    let mut command = Command::new("psql");
    command
        .arg(idem_e2e::admin_url())
        .args(["-v", "ON_ERROR_STOP=1", "-qAt"]);
    for sql in commands {
        command.args(["-c", sql]);
    }
    let status = command.status().expect("run psql");
    assert!(status.success(), "psql {commands:?} failed");
}

/// The loyalty pipeline's config file for the real binary, with `extra` in its table.
fn config_file(env: &TestEnv, extra: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, env.config_text("loyalty", extra)).expect("write config");
    path
}

async fn credited(env: &TestEnv) -> i64 {
    env.count("SELECT count(*) FROM point_ledger").await
}

/// PostgreSQL turns read-only for 15 s under load (as after a failover to a node that is not
/// yet primary), with one message per transaction and with batches: every claim and effect
/// fails with 25006, which is the database's fault: nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_window_dead_letters_nothing() {
    let _serial = SERIAL.lock().await;
    for batch in [1, 64] {
        let env = TestEnv::new(&format!("fault_read_only_{batch}")).await;
        let config = config_file(&env, &format!("[pipelines.loyalty.batch]\nsize = {batch}"));
        let host = spawn_idem(&config, &[]);
        let orders = sized(3_000, 6_000) as i64;
        let publisher = tokio::spawn(publish_orders(env.queue.clone(), 1, orders, 0.1));
        wait_for("the first credits", Duration::from_secs(60), || async {
            credited(&env).await > 0
        })
        .await;
        let read_only = SystemSetting::set("default_transaction_read_only", "on");
        // Transactions begun before the reload reached their session may still commit.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = credited(&env).await;
        tokio::time::sleep(Duration::from_secs(14)).await;
        let during = credited(&env).await;
        drop(read_only);
        let published = publisher.await.expect("publisher");
        wait_settled(&env, &published, Duration::from_secs(180)).await;
        stop(host);
        assert_eq!(during, before, "writes went through while read-only");
        check(
            &env,
            &format!("read-only for 15 s, batch size {batch}"),
            &published,
            1,
        )
        .await;
        env.cleanup().await;
    }
}

/// `pg_cancel_backend` on the host's active queries in a tight loop until at least 30 cancels
/// have landed (bounded at 60 s): a cancelled statement (57014) is the operator's doing, never
/// the message's. The loop counts landed cancels rather than running for a fixed time: each
/// cancelled message backs off, so a fixed window under load could land too few to test anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_queries_dead_letter_nothing() {
    const LANDED: u64 = 30;
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_cancel").await;
    // Each credit takes 20 ms, so the host always has a query running to cancel.
    env.slow_ledger("true", 0.02).await;
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(
        env.config("loyalty", "[pipelines.loyalty.batch]\nsize = 1"),
        Arc::clone(&metrics),
    );
    let published = publish_orders(env.queue.clone(), 1, sized(3_000, 6_000) as i64, 0.1).await;
    // Under load the host may take seconds to start: cancel only once it is crediting.
    wait_for("the first credits", Duration::from_secs(60), || async {
        credited(&env).await > 0
    })
    .await;
    let admin = sqlx::PgPool::connect(&idem_e2e::admin_url())
        .await
        .expect("admin pool");
    let started = Instant::now();
    let mut signalled = 0u64;
    while metrics.database_retries("loyalty", "57014") < LANDED
        && started.elapsed() < Duration::from_secs(60)
    {
        let sent: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND application_name = 'idem' AND state = 'active'",
        )
        .bind(&env.database)
        .fetch_all(&admin)
        .await
        .expect("cancel backends");
        signalled += sent.len() as u64;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let landed = metrics.database_retries("loyalty", "57014");
    wait_settled(&env, &published, Duration::from_secs(240)).await;
    host.stop().await.expect("host stops cleanly");
    eprintln!(
        "faults: cancels: {signalled} signalled, {landed} landed (57014 retried) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        landed >= LANDED,
        "only {landed} cancels landed in 60 s; nothing was tested"
    );
    check(&env, "queries cancelled", &published, landed).await;
    env.cleanup().await;
}

/// The host's established database connections go silent (packets lost, as when a failover
/// moves the address or a NAT forgets the flow) while new connections work: the transaction
/// deadline abandons them, the server ends their sessions (idle in transaction), and the
/// pipeline resumes on new connections within 60 s, with the default settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_are_abandoned_within_60s() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_half_open").await;
    let proxy = Proxy::start("127.0.0.1:5432".parse().expect("address")).await;
    let config = config_via_proxy(&env, &proxy);
    let metrics = Arc::new(Metrics::new());
    let published = publish_orders(env.queue.clone(), 1, sized(3_000, 10_000) as i64, 0.1).await;
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    wait_for("the first credits", Duration::from_secs(60), || async {
        credited(&env).await > 100
    })
    .await;
    proxy.silence_all();
    let silenced = Instant::now();
    wait_settled(&env, &published, Duration::from_secs(120)).await;
    let resumed = silenced.elapsed();
    host.stop().await.expect("host stops cleanly");
    eprintln!(
        "faults: half-open: every order settled {:.1} s after the connections went silent",
        resumed.as_secs_f64()
    );
    assert!(
        resumed < Duration::from_secs(60),
        "took {resumed:?} to resume after half-open connections"
    );
    check(&env, "half-open connections", &published, 1).await;
    drop(proxy);
    env.cleanup().await;
}

/// `ALTER TABLE` under load changes the result type of a statement with `RETURNING *`: the
/// cached plan is outdated (0A000); a new connection plans it anew. Nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn altered_table_under_load_dead_letters_nothing() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_alter").await;
    let text = env
        .config_text("loyalty", "")
        .replace("VALUES ($1, $2, $3)\"", "VALUES ($1, $2, $3) RETURNING *\"");
    assert!(text.contains("RETURNING *"), "the statement was rewritten");
    let path = std::env::temp_dir().join(format!("{}.toml", env.database));
    std::fs::write(&path, text).expect("write config");
    let host = spawn_idem(&path, &[]);
    let publisher = tokio::spawn(publish_orders(
        env.queue.clone(),
        1,
        sized(4_000, 10_000) as i64,
        0.1,
    ));
    wait_for("the first credits", Duration::from_secs(60), || async {
        credited(&env).await > 0
    })
    .await;
    let alters = 5;
    for column in 0..alters {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE point_ledger ADD COLUMN extra_{column} int"
        )))
        .execute(&env.pool)
        .await
        .expect("alter table");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(180)).await;
    stop(host);
    check(&env, "ALTER TABLE under load", &published, alters).await;
    env.cleanup().await;
}

/// A `REVOKE` on an effect's table mid-run is a configuration fault: the pipeline pauses
/// (`/readyz` 503 naming it, the statement and the SQLSTATE), nothing is dead-lettered, and
/// after the `GRANT` it resumes by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_grant_pauses_the_pipeline_until_granted() {
    let _serial = SERIAL.lock().await;
    let env = TestEnv::new("fault_revoke").await;
    let role = format!("{}_writer", env.database);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP ROLE IF EXISTS \"{role}\"; CREATE ROLE \"{role}\" NOLOGIN; \
         GRANT SELECT, INSERT, UPDATE ON point_ledger, balances TO \"{role}\";"
    )))
    .execute(&env.pool)
    .await
    .expect("role");
    let port = idem_e2e::free_port();
    let text = format!(
        "{}\n[http]\nlisten = \"127.0.0.1:{port}\"\n",
        env.config_text(
            "loyalty",
            &format!("[pipelines.loyalty.transaction]\nrole = \"{role}\"")
        )
    );
    let config = idem_host::config::Config::from_toml(std::path::Path::new("/tmp/r.toml"), &text)
        .expect("config");
    let metrics = Arc::new(Metrics::new());
    let host = env.start_host_with_metrics(config, Arc::clone(&metrics));
    let publisher = tokio::spawn(publish_orders(
        env.queue.clone(),
        1,
        sized(2_000, 5_000) as i64,
        0.1,
    ));
    wait_for("the first credits", Duration::from_secs(60), || async {
        credited(&env).await > 0
    })
    .await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "REVOKE INSERT ON point_ledger FROM \"{role}\""
    )))
    .execute(&env.pool)
    .await
    .expect("revoke");
    wait_for("the pipeline to pause", Duration::from_secs(30), || async {
        metrics.is_paused("loyalty") == 1
    })
    .await;
    let (status, body) = idem_e2e::http_request(port, "GET", "/readyz", None).await;
    assert_eq!(status, 503, "{body}");
    for word in ["loyalty", "record_ledger", "42501"] {
        assert!(body.contains(word), "/readyz does not name {word}: {body}");
    }
    let paused_at = credited(&env).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(credited(&env).await, paused_at, "credits while paused");
    assert_eq!(
        env.ready(&env.dead_letter_queue).await,
        0,
        "dead letters while paused"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "GRANT INSERT ON point_ledger TO \"{role}\""
    )))
    .execute(&env.pool)
    .await
    .expect("grant");
    let granted = Instant::now();
    let published = publisher.await.expect("publisher");
    wait_settled(&env, &published, Duration::from_secs(120)).await;
    eprintln!(
        "faults: revoke: paused, then every order settled {:.1} s after the grant",
        granted.elapsed().as_secs_f64()
    );
    assert_eq!(metrics.is_paused("loyalty"), 0, "still paused");
    let (status, body) = idem_e2e::http_request(port, "GET", "/readyz", None).await;
    assert_eq!(status, 200, "{body}");
    host.stop().await.expect("host stops cleanly");
    check(&env, "REVOKE then GRANT", &published, 1).await;
    let role_cleanup = format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\";");
    env.cleanup().await;
    psql(&[&role_cleanup]);
}
