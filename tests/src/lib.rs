//! Test harness: real PostgreSQL and RabbitMQ, isolated per test.
//!
//! Each [`TestEnv`] owns a fresh database (host migrations and the demo schema applied) and
//! uniquely named queues, so tests run in parallel and repeatedly. Endpoints come from
//! `IDEM_TEST_PG_ADMIN_URL` and `AMQP_URL`, defaulting to the local services.
//!
//! The environment is `env`, the `idem` binary and the machine's processes `process`,
//! RabbitMQ `amqp`, plain HTTP `http` (all re-exported here); a topology or a service of a
//! test's own has its module (`jetstream`, `pgbouncer`, `pg_cluster`, `rabbit_cluster`, …).

pub mod auto_failover;
pub mod browser;
pub mod jetstream;
pub mod kafka;
pub mod otlp;
pub mod pg_cluster;
pub mod pgbouncer;
pub mod proxy;
pub mod rabbit_cluster;
pub mod soak;
pub mod tls;

mod amqp;
mod env;
mod http;
mod process;

pub use amqp::*;
pub use env::*;
pub use http::*;
pub use process::*;

use std::time::{Duration, Instant};

/// Where the test plugins were built (`plugins/dist`).
pub const PLUGIN_DIST: &str = env!("IDEM_PLUGIN_DIST");
/// The repository root.
pub const REPO_ROOT: &str = env!("IDEM_REPO_ROOT");

/// An `OrderCompleted` body.
pub fn order(order_id: i64, customer_id: i64, total_cents: i64) -> Vec<u8> {
    serde_json::json!({
        "type": "OrderCompleted",
        "order_id": order_id,
        "customer_id": customer_id,
        "total_cents": total_cents,
    })
    .to_string()
    .into_bytes()
}

/// Polls `condition` every 50 ms until it holds or `timeout` passes.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !condition().await {
        assert!(
            started.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
