//! Shared measurement helpers for the benchmarks in `src/bin/`.

use std::time::Duration;

pub mod delay;

/// Latency percentiles of a sample set.
#[derive(Debug, Clone, Copy)]
pub struct Percentiles {
    pub p50: Duration,
    pub p99: Duration,
    pub mean: Duration,
}

impl Percentiles {
    /// Sorts `samples` and reads its percentiles.
    pub fn of(samples: &mut [Duration]) -> Percentiles {
        samples.sort_unstable();
        let at = |fraction: f64| {
            let index = ((samples.len() as f64 - 1.0) * fraction).round() as usize;
            samples.get(index).copied().unwrap_or_default()
        };
        let total: Duration = samples.iter().sum();
        Percentiles {
            p50: at(0.50),
            p99: at(0.99),
            mean: total / u32::try_from(samples.len().max(1)).unwrap_or(u32::MAX),
        }
    }
}

/// Microseconds with one decimal, for tables.
pub fn micros(duration: Duration) -> String {
    format!("{:.1} µs", duration.as_secs_f64() * 1e6)
}

/// The body of `OrderCompleted` number `order_id`, the loyalty plugin's input in every
/// benchmark (customers and totals vary with the id).
pub fn order_body(order_id: i64) -> Vec<u8> {
    format!(
        r#"{{"type": "OrderCompleted", "order_id": {order_id}, "customer_id": {}, "total_cents": {}}}"#,
        order_customer(order_id),
        order_total_cents(order_id)
    )
    .into_bytes()
}

/// The customer of order `order_id` in [`order_body`].
pub fn order_customer(order_id: i64) -> i64 {
    order_id % 97
}

/// The total of order `order_id` in [`order_body`], in cents.
pub fn order_total_cents(order_id: i64) -> i64 {
    1000 + order_id * 7 % 9000
}

/// The repository's `pipelines.toml` (the loyalty pipeline) pointed at `database_url`.
pub fn demo_config(database_url: &str) -> idem_host::config::Config {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("pipelines.toml")).expect("pipelines.toml");
    let text = text.replace(
        "${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/idem_demo}",
        database_url,
    );
    idem_host::config::Config::from_toml(&root.join("pipelines.toml"), &text)
        .expect("pipelines.toml is valid")
}

/// A fresh database at `config`'s `[database] url` (created through `admin_url` if missing,
/// emptied if not) with idem's tables and the loyalty schema, and `pipeline`'s statements
/// prepared.
pub async fn loyalty_database(
    admin_url: &str,
    config: &idem_host::config::Config,
    pipeline: &idem_host::config::PipelineConfig,
) -> (sqlx::PgPool, idem_host::store::statement::StatementCatalog) {
    let database_url = config.database.url.as_str();
    const SCHEMA: &str = include_str!("../../examples/loyalty/schema.sql");
    let admin = sqlx::PgPool::connect(admin_url)
        .await
        .expect("PostgreSQL reachable");
    let database = database_url
        .rsplit('/')
        .next()
        .and_then(|name| name.split('?').next())
        .expect("a database name");
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE \"{database}\""
    )))
    .execute(&admin)
    .await;
    admin.close().await;
    let pool = sqlx::PgPool::connect(database_url)
        .await
        .expect("bench database");
    idem_host::store::database::migrate_tables(&pool, &Default::default(), Default::default())
        .await
        .expect("migrations");
    sqlx::raw_sql(SCHEMA).execute(&pool).await.expect("schema");
    sqlx::raw_sql("TRUNCATE processed_messages, balances, point_ledger")
        .execute(&pool)
        .await
        .expect("empty tables");
    let sessions = idem_host::store::database::open(&config.database)
        .await
        .expect("idem's sessions")
        .sessions;
    let catalog = idem_host::store::statement::StatementCatalog::prepare(&sessions, pipeline)
        .await
        .expect("statements prepare");
    sessions.close_idle();
    (pool, catalog)
}

/// The loyalty plugin's decision for an order, computed natively.
pub fn loyalty_decision(
    order_id: i64,
    customer_id: i64,
    total_cents: i64,
) -> idem_host::effect::Decision {
    use idem_host::effect::{Decision, Effect, Value};
    let points = total_cents / 100;
    Decision {
        key: format!("order-completed:{order_id}"),
        effects: vec![
            Effect::Exec {
                statement: "credit_balance".into(),
                params: vec![Value::Integer(customer_id), Value::Integer(points)],
            },
            Effect::Exec {
                statement: "record_ledger".into(),
                params: vec![
                    Value::Integer(customer_id),
                    Value::Integer(order_id),
                    Value::Integer(points),
                ],
            },
        ],
    }
}
