//! `[database] url` listing several hosts, as libpq and the HA managers hand them out:
//! idem works on the one that takes writes, and follows it when it moves.

use std::path::Path;
use std::time::Duration;

use idem_e2e::pg_cluster::PgCluster;
use idem_e2e::{TestEnv, create_database, must_succeed, order, wait_for};
use idem_host::config::Config;

async fn publish_orders(env: &TestEnv, ids: std::ops::RangeInclusive<i64>) {
    for order_id in ids {
        env.publish(&order(
            order_id,
            order_id % 25,
            100 + (order_id * 37) % 10_000,
        ))
        .await;
    }
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .expect("count")
}

/// A host that is down, then one that takes no writes (`default_transaction_read_only`, as a
/// standby), then the machine's server: `idem migrate`, `idem check` and `idem run` all work
/// on the last one, and nothing lands anywhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_writes_where_writes_are_taken() {
    let env = TestEnv::new("hosts_list").await;
    let read_only = PgCluster::start(&env.database, "");
    read_only.psql(&format!("CREATE DATABASE \"{}\"", env.database));
    read_only.set_read_only(true);
    let down = idem_e2e::free_port();
    let url = format!(
        "postgres://postgres@127.0.0.1:{down},127.0.0.1:{},127.0.0.1:5432/{}?sslmode=disable&target_session_attrs=read-write",
        read_only.port, env.database
    );
    let text = env.config_text_at(&url, "loyalty", "");
    let path = std::env::temp_dir().join(format!("{}-hosts.toml", env.database));
    std::fs::write(&path, &text).expect("config");
    must_succeed("migrate", &path);
    must_succeed("check", &path);
    let host = env.start_host(Config::from_toml(&path, &text).expect("config"));
    publish_orders(&env, 1..=300).await;
    wait_for("300 ledger rows", Duration::from_secs(60), || async {
        env.count("SELECT count(*) FROM point_ledger").await == 300
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    env.assert_loyalty_consistent().await;
    let tables = sqlx::PgPool::connect(&read_only.url(&env.database))
        .await
        .expect("the read-only host");
    assert_eq!(
        count(
            &tables,
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        )
        .await,
        0,
        "idem wrote on the host that takes no writes"
    );
    tables.close().await;
    drop(read_only);
    env.cleanup().await;
}

/// Two clusters of the test's own, the first listed taking no writes: idem works on the
/// second. Then the roles swap (the writable one demoted and its sessions ended, the other
/// promoted, as a failover does): the next orders land on the new one, the sessions and the
/// bookkeeping pool follow without a restart, and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writable_host_moves_and_idem_follows() {
    let env = TestEnv::new("hosts_move").await;
    let first = PgCluster::start(&format!("{}_a", env.database), "");
    let second = PgCluster::start(&format!("{}_b", env.database), "");
    let (_, first_pool) = create_database(&first.url("postgres"), &env.database).await;
    let (_, second_pool) = create_database(&second.url("postgres"), &env.database).await;
    first.set_read_only(true);
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{}?sslmode=disable",
        first.port, second.port, env.database
    );
    let text = env.config_text_at(&url, "loyalty", "");
    let config = Config::from_toml(Path::new("/tmp/hosts-move.toml"), &text).expect("config");
    let database = idem_host::store::database::open(&config.database)
        .await
        .expect("the hosts");
    let bookkeeping_port = || async {
        sqlx::query_scalar::<_, i32>("SELECT inet_server_port()")
            .fetch_one(&database.pool)
            .await
            .ok()
    };
    assert_eq!(bookkeeping_port().await, Some(i32::from(second.port)));
    let host = env.start_host(config);
    publish_orders(&env, 1..=200).await;
    wait_for(
        "200 ledger rows on the second",
        Duration::from_secs(60),
        || async { count(&second_pool, "SELECT count(*) FROM point_ledger").await == 200 },
    )
    .await;
    wait_for("the queue drained", Duration::from_secs(30), || async {
        env.ready(&env.queue).await == 0 && idem_e2e::unacked(&env.queue) == 0
    })
    .await;

    // The failover: the second stops taking writes and drops its sessions; the first takes them.
    second.set_read_only(true);
    second.psql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = 'idem' AND pid <> pg_backend_pid()",
    );
    first.set_read_only(false);
    publish_orders(&env, 201..=400).await;
    wait_for(
        "200 ledger rows on the first",
        Duration::from_secs(60),
        || async { count(&first_pool, "SELECT count(*) FROM point_ledger").await == 200 },
    )
    .await;
    wait_for(
        "the bookkeeping pool on the first",
        Duration::from_secs(20),
        || async { bookkeeping_port().await == Some(i32::from(first.port)) },
    )
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    for (pool, range) in [(&second_pool, (1, 200)), (&first_pool, (201, 400))] {
        let outside = count(
            pool,
            &format!(
                "SELECT count(*) FROM point_ledger WHERE order_id NOT BETWEEN {} AND {}",
                range.0, range.1
            ),
        )
        .await;
        assert_eq!(outside, 0, "orders {range:?} landed elsewhere");
        let claims = count(pool, "SELECT count(*) FROM processed_messages").await;
        assert_eq!(claims, 200, "claims of orders {range:?}");
    }
    database.pool.close().await;
    database.sessions.close_idle();
    first_pool.close().await;
    second_pool.close().await;
    drop((first, second));
    env.cleanup().await;
}
