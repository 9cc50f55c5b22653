//! idem in a database it shares with the application that owns the business tables: its own
//! tables and migration history in `[database] schema`, apart from the application's sqlx
//! migrations and from a hand-written consumer's `processed_messages`; an installation from
//! before the setting moved into its schema with every claim.

use std::path::{Path, PathBuf};
use std::time::Duration;

use idem_e2e::{TestEnv, count, must_succeed, order, wait_for};
use idem_host::config::Config;
use sqlx::PgPool;

/// `env`'s config on `url`, with `database_keys` added to its `[database]` table.
fn config_text(env: &TestEnv, url: &str, database_keys: &str) -> String {
    env.config_text_at(url, "loyalty", "").replacen(
        "[database]\n",
        &format!("[database]\n{database_keys}"),
        1,
    )
}

fn write(env: &TestEnv, name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("{}-{name}.toml", env.database));
    std::fs::write(&path, text).expect("write config");
    path
}

/// The application's own sqlx migrations: the loyalty tables, in a directory of their own.
async fn application_migrator(env: &TestEnv) -> sqlx::migrate::Migrator {
    let directory = std::env::temp_dir().join(format!("{}-app-migrations", env.database));
    std::fs::create_dir_all(&directory).expect("migrations directory");
    let schema = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/loyalty/schema.sql"),
    )
    .expect("the loyalty schema");
    std::fs::write(directory.join("20250101000001_loyalty.sql"), schema).expect("migration");
    sqlx::migrate::Migrator::new(directory.as_path())
        .await
        .expect("the application's migrations")
}

async fn exists(pool: &PgPool, table: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(pool)
        .await
        .expect("to_regclass")
}

/// Publishes orders `ids` once each.
async fn publish(env: &TestEnv, ids: std::ops::RangeInclusive<i64>) {
    for order_id in ids {
        env.publish(&order(order_id, order_id % 10, 100 + order_id))
            .await;
    }
}

/// Runs a host with `config` until `ledger_rows` orders are applied and the queue is empty.
async fn run_until(env: &TestEnv, pool: &PgPool, config: Config, ledger_rows: i64) {
    let host = env.start_host(config);
    wait_for(
        &format!("{ledger_rows} ledger rows"),
        Duration::from_secs(60),
        || async { count(pool, "SELECT count(*) FROM point_ledger").await == ledger_rows },
    )
    .await;
    wait_for("the queue drained", Duration::from_secs(30), || async {
        env.ready(&env.queue).await == 0 && idem_e2e::unacked(&env.queue) == 0
    })
    .await;
    host.stop().await.expect("host stops cleanly");
    assert_eq!(env.ready(&env.dead_letter_queue).await, 0, "dead letters");
    assert_eq!(
        count(pool, "SELECT count(*) FROM point_ledger").await,
        ledger_rows,
        "an order was credited twice"
    );
}

/// A database the application owns: its sqlx migrations (`_sqlx_migrations`) made the
/// loyalty tables, and a hand-written consumer's `processed_messages` of another shape sits
/// in `public`. With `schema = "idem"`, `idem migrate` leaves both alone, the application's
/// migrator runs again without tripping over idem's versions, and the host's claims land in
/// `idem.processed_messages`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_and_the_application_keep_their_own_tables_and_migrations() {
    let env = TestEnv::new("shared_schema").await;
    let shared = format!("{}_app", env.database);
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{shared}\"")))
        .execute(&env.pool)
        .await
        .expect("create database");
    let shared_url = env.database_url.replace(&env.database, &shared);
    let pool = PgPool::connect(&shared_url).await.expect("connect");
    let application = application_migrator(&env).await;
    application
        .run(&pool)
        .await
        .expect("the application migrates");
    sqlx::raw_sql(
        "CREATE TABLE processed_messages (message_id text PRIMARY KEY, \
         processed_at timestamptz NOT NULL, handler text NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("a hand-written consumer's table");

    let text = config_text(&env, &shared_url, "schema = \"idem\"\n");
    let path = write(&env, "shared", &text);
    let migrated = must_succeed("migrate", &path);
    assert!(migrated.contains("in schema \"idem\""), "{migrated}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idem.idem_migrations").await as usize,
        idem_host::store::database::MIGRATOR.iter().count(),
        "idem's history is its own"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM public._sqlx_migrations").await,
        1,
        "the application's history holds only its own migration"
    );
    application
        .run(&pool)
        .await
        .expect("the application's migrator runs again, seeing none of idem's versions");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM information_schema.columns \
             WHERE table_schema = 'public' AND table_name = 'processed_messages'"
        )
        .await,
        3,
        "the consumer's own table was changed"
    );
    let again = must_succeed("migrate", &path);
    assert!(again.contains("(0 new)"), "{again}");
    must_succeed("check", &path);

    publish(&env, 1..=50).await;
    publish(&env, 1..=10).await;
    run_until(
        &env,
        &pool,
        Config::from_toml(&path, &text).expect("config"),
        50,
    )
    .await;
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idem.processed_messages WHERE consumer = 'loyalty'"
        )
        .await,
        50
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM public.processed_messages").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT order_id) FROM point_ledger").await,
        50
    );
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE \"{shared}\" WITH (FORCE)"
    )))
    .execute(&env.pool)
    .await
    .expect("drop database");
    env.cleanup().await;
}

/// An installation from before idem had a history of its own: its versions in sqlx's
/// `_sqlx_migrations`, beside an application's. `idem migrate` moves idem's rows into
/// `idem_migrations` and leaves the application's. Its claims are then partitioned by day,
/// and later the operator sets `schema = "idem"`: `idem migrate` moves the tables and their
/// partitions there with every claim, so orders delivered again are still duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_installation_moves_into_its_schema_with_its_claims() {
    let env = TestEnv::new("schema_move").await;
    sqlx::raw_sql(
        "CREATE TABLE _sqlx_migrations (version bigint PRIMARY KEY, description text NOT NULL, \
           installed_on timestamptz NOT NULL DEFAULT now(), success boolean NOT NULL, \
           checksum bytea NOT NULL, execution_time bigint NOT NULL); \
         INSERT INTO _sqlx_migrations SELECT * FROM idem_migrations; \
         INSERT INTO _sqlx_migrations VALUES (1, 'the application', now(), true, '\\x00', 1); \
         DROP TABLE idem_migrations",
    )
    .execute(&env.pool)
    .await
    .expect("an installation of an earlier version");
    let before = env.config_text("loyalty", "");
    let before_path = write(&env, "before", &before);
    let adopted = must_succeed("migrate", &before_path);
    assert!(
        adopted.contains("out of _sqlx_migrations") && adopted.contains("(0 new)"),
        "{adopted}"
    );
    assert_eq!(
        count(&env.pool, "SELECT count(*) FROM _sqlx_migrations").await,
        1,
        "the application's row stays"
    );
    assert_eq!(
        count(&env.pool, "SELECT count(*) FROM public.idem_migrations").await as usize,
        idem_host::store::database::MIGRATOR.iter().count()
    );
    publish(&env, 1..=100).await;
    run_until(
        &env,
        &env.pool,
        Config::from_toml(&before_path, &before).expect("config"),
        100,
    )
    .await;

    let partitioned = must_succeed("partition", &before_path);
    assert!(partitioned.contains("is now partitioned"), "{partitioned}");

    let after = config_text(&env, &env.database_url, "schema = \"idem\"\n");
    let after_path = write(&env, "after", &after);
    let moved = must_succeed("migrate", &after_path);
    assert!(
        moved.contains("moved idem's tables from schema \"public\""),
        "{moved}"
    );
    for table in [
        "processed_messages",
        "idem_outbox",
        "idem_consumers",
        "idem_dead_letters",
        "idem_migrations",
    ] {
        // The history stays behind as a copy, marked: what an older idem finds there.
        assert_eq!(
            exists(&env.pool, &format!("public.{table}")).await,
            table == "idem_migrations",
            "{table} left behind"
        );
        assert!(
            exists(&env.pool, &format!("idem.{table}")).await,
            "{table} not moved"
        );
    }
    assert_eq!(
        count(
            &env.pool,
            "SELECT count(*) FROM public.idem_migrations WHERE description = 'moved to schema \"idem\"'"
        )
        .await,
        1,
        "the marker of the move"
    );
    assert_eq!(
        count(&env.pool, "SELECT count(*) FROM idem.processed_messages").await,
        100
    );
    let partitions = "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'idem.processed_messages'::regclass \
           AND c.relnamespace = 'idem'::regnamespace";
    assert!(
        count(&env.pool, partitions).await > 1,
        "the day partitions stayed behind"
    );
    // Orders 51 to 100 again (duplicates of moved claims), and 50 new ones.
    publish(&env, 51..=150).await;
    run_until(
        &env,
        &env.pool,
        Config::from_toml(&after_path, &after).expect("config"),
        150,
    )
    .await;
    assert_eq!(
        count(
            &env.pool,
            "SELECT count(DISTINCT order_id) FROM point_ledger"
        )
        .await,
        150,
        "an order was credited twice"
    );
    assert_eq!(
        count(&env.pool, "SELECT count(*) FROM idem.processed_messages").await,
        150
    );
    env.cleanup().await;
}
