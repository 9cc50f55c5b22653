//! Retention (the guide's Step 5): delete claims older than a pipeline's window, in small
//! batches, so the ledger does not grow forever and locks and WAL bursts stay short.
//!
//! Architecture invariant: only claims of the pipeline's own consumer and older than its
//! window are deleted, and only one host cleans at a time (an advisory lock held by an open
//! transaction, which a transaction pooler keeps on one server connection).

use std::collections::BTreeMap;
use std::sync::Arc;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{DatabaseConfig, PipelineConfig, RetentionConfig, redact_url};
use crate::store::bookkeeping;
use crate::store::database::{Database, DatabaseError};
use crate::store::partition::{self, Maintenance};
use crate::store::tables::Tables;
use crate::telemetry::metrics::Metrics;

/// The advisory lock that elects the one cleaning host of idem's tables in one schema (two
/// installations in one database, in schemas of their own, each clean theirs).
const RETENTION_LOCK_SQL: &str =
    "SELECT pg_try_advisory_xact_lock(hashtextextended('idem-retention ' || {schema}, 0))";

/// The same, for tables in the search path's first schema, where hosts older than
/// `[database] schema` clean too, under a constant key: both keys, so that in a rolling
/// upgrade an old and a new host never clean (or create and drop partitions) at once.
const UNQUALIFIED_RETENTION_LOCK_SQL: &str = "SELECT pg_try_advisory_xact_lock(x'1de3000000000001'::int8) \
     AND pg_try_advisory_xact_lock(hashtextextended('idem-retention ' || {schema}, 0))";

/// One batch: at most `$3` claims of consumer `$1` older than `$2` seconds.
const DELETE_BATCH_SQL: &str = "DELETE FROM {claims} \
     WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) \
       AND ctid IN (SELECT ctid FROM {claims} \
                    WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) \
                    LIMIT $3)";

/// A consumer's claims: how many, and how long ago the oldest was made (`None`: none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClaimsSummary {
    pub rows: i64,
    pub oldest_age: Option<std::time::Duration>,
}

/// Counts `consumer`'s claims (its range of the primary key) and finds its oldest, for
/// `idem status` and the sampled gauges.
pub async fn claims_summary(
    pool: &PgPool,
    tables: &Tables,
    consumer: &str,
) -> Result<ClaimsSummary, sqlx::Error> {
    let (rows, oldest): (i64, Option<f64>) =
        bookkeeping::in_transaction(pool, async |connection| {
            bookkeeping::query_as(&tables.sql(
                "SELECT count(*), extract(epoch FROM now() - min(processed_at))::float8 \
                 FROM {claims} WHERE consumer = $1",
            ))
            .bind(consumer)
            .fetch_one(connection)
            .await
        })
        .await?;
    Ok(ClaimsSummary {
        rows,
        oldest_age: oldest.map(|seconds| std::time::Duration::from_secs_f64(seconds.max(0.0))),
    })
}

/// Records the retention window of every pipeline's consumer (see `record_windows`).
pub async fn record_consumers(
    pool: &PgPool,
    config: &DatabaseConfig,
    pipelines: &[PipelineConfig],
) -> Result<(), DatabaseError> {
    let windows = pipelines
        .iter()
        .map(|pipeline| (pipeline.consumer.as_str(), pipeline.retention.window));
    record_windows(pool, &Tables::of(config), windows)
        .await
        .map_err(|source| DatabaseError::Consumers {
            endpoint: redact_url(&config.url),
            source,
        })
}

/// Records each consumer's retention window in `idem_consumers`, so partition mode keeps
/// claims for the longest window of every consumer sharing the table, whichever host cleans.
pub async fn record_windows(
    pool: &PgPool,
    tables: &Tables,
    windows: impl IntoIterator<Item = (&str, std::time::Duration)>,
) -> Result<(), sqlx::Error> {
    let mut longest: BTreeMap<&str, std::time::Duration> = BTreeMap::new();
    for (consumer, window) in windows {
        let entry = longest.entry(consumer).or_default();
        *entry = (*entry).max(window);
    }
    bookkeeping::in_transaction(pool, async |connection| {
        for (consumer, window) in longest {
            bookkeeping::query(&tables.sql(
                "INSERT INTO {consumers} (consumer, retention_window) \
                 VALUES ($1, make_interval(secs => $2)) \
                 ON CONFLICT (consumer) DO UPDATE \
                   SET retention_window = EXCLUDED.retention_window, recorded_at = now()",
            ))
            .bind(consumer)
            .bind(window.as_secs_f64())
            .execute(&mut *connection)
            .await?;
        }
        Ok(())
    })
    .await
}

/// What a cleaning pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pass {
    /// Claims deleted, by consumer.
    Cleaned(BTreeMap<String, u64>),
    /// Partition mode: partitions created ahead and dropped whole.
    Partitions(Maintenance),
    /// Another host holds the cleaning lock.
    Busy,
}

/// Deletes the claims of `consumer` older than `window`, `batch_size` rows at a time with a
/// pause between batches, until none is left or `shutdown` fires. Returns the rows deleted.
pub async fn clean_consumer(
    pool: &PgPool,
    tables: &Tables,
    consumer: &str,
    retention: &RetentionConfig,
    shutdown: &CancellationToken,
) -> Result<u64, sqlx::Error> {
    let mut deleted_total = 0;
    loop {
        let deleted = bookkeeping::in_transaction(pool, async |connection| {
            bookkeeping::query(&tables.sql(DELETE_BATCH_SQL))
                .bind(consumer)
                .bind(retention.window.as_secs_f64())
                .bind(i64::from(retention.batch_size.get()))
                .execute(connection)
                .await
        })
        .await?
        .rows_affected();
        deleted_total += deleted;
        debug!(consumer, deleted, "Retention batch.");
        if deleted == 0 || shutdown.is_cancelled() {
            return Ok(deleted_total);
        }
        tokio::select! {
            () = tokio::time::sleep(retention.pause) => {}
            () = shutdown.cancelled() => return Ok(deleted_total),
        }
    }
}

/// One pass over every pipeline, if this host wins the cleaning lock.
pub async fn clean_all(
    pool: &PgPool,
    tables: &Tables,
    pipelines: &[(String, String, RetentionConfig)],
    metrics: Option<&Metrics>,
    shutdown: &CancellationToken,
) -> Result<Pass, sqlx::Error> {
    // The lock's transaction idles while the pass runs on other connections: the server's
    // idle limit does not apply to it (keepalives still end it if this host vanishes).
    let mut lock =
        bookkeeping::begin(pool, "SET LOCAL idle_in_transaction_session_timeout = 0").await?;
    let lock_sql = match tables.schema() {
        Some(_) => RETENTION_LOCK_SQL,
        None => UNQUALIFIED_RETENTION_LOCK_SQL,
    };
    let locked: bool = bookkeeping::query_scalar(&tables.sql(lock_sql))
        .fetch_one(&mut *lock)
        .await?;
    if !locked {
        return Ok(Pass::Busy);
    }
    let result = clean_locked(pool, tables, pipelines, metrics, shutdown).await;
    // Ending the transaction releases the lock; if that fails, the connection closes with it.
    lock.rollback().await?;
    result
}

async fn clean_locked(
    pool: &PgPool,
    tables: &Tables,
    pipelines: &[(String, String, RetentionConfig)],
    metrics: Option<&Metrics>,
    shutdown: &CancellationToken,
) -> Result<Pass, sqlx::Error> {
    if partition::is_partitioned(pool, tables).await? {
        // Partitions hold every consumer's claims: keep them for the longest window.
        let window = pipelines
            .iter()
            .map(|(_, _, retention)| retention.window)
            .max()
            .unwrap_or_else(|| RetentionConfig::default().window);
        return partition::maintain(pool, tables, window)
            .await
            .map(Pass::Partitions);
    }
    let mut cleaned = BTreeMap::new();
    for (pipeline, consumer, retention) in pipelines {
        let deleted = clean_consumer(pool, tables, consumer, retention, shutdown).await?;
        if let Some(metrics) = metrics {
            metrics.claims_deleted(pipeline, deleted);
        }
        *cleaned.entry(consumer.clone()).or_insert(0) += deleted;
    }
    Ok(Pass::Cleaned(cleaned))
}

/// Runs [`clean_all`] every pipeline's `every` interval (the shortest), until `shutdown`.
pub fn spawn_cleaner(
    pipelines: &[PipelineConfig],
    database: Database,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let cleaned: Vec<(String, String, RetentionConfig)> = pipelines
        .iter()
        .filter(|pipeline| !pipeline.retention.every.is_zero())
        .map(|pipeline| {
            (
                pipeline.name.clone(),
                pipeline.consumer.clone(),
                pipeline.retention.clone(),
            )
        })
        .collect();
    let Some(every) = cleaned
        .iter()
        .map(|(_, _, retention)| retention.every)
        .min()
    else {
        return;
    };
    tokio::spawn(async move {
        // First pass at start: in partition mode it creates today's partitions.
        loop {
            let (pool, tables) = (&database.pool, &database.tables);
            match clean_all(pool, tables, &cleaned, Some(&metrics), &shutdown).await {
                Ok(Pass::Cleaned(deleted)) => {
                    let total: u64 = deleted.values().sum();
                    if total > 0 {
                        info!(deleted = total, "Retention removed old claims.");
                    }
                }
                Ok(Pass::Partitions(maintenance)) => {
                    if !maintenance.created.is_empty() || !maintenance.dropped.is_empty() {
                        info!(created = ?maintenance.created, dropped = ?maintenance.dropped, "Claim partitions maintained.");
                    }
                    if maintenance.stray_rows > 0 {
                        warn!(
                            rows = maintenance.stray_rows,
                            "Claims landed in processed_messages_default (no partition for their day); they are kept but never dropped."
                        );
                    }
                }
                Ok(Pass::Busy) => debug!("Another host is cleaning claims."),
                Err(error) => warn!(%error, "Retention pass failed; will try again."),
            }
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = shutdown.cancelled() => return,
            }
        }
    });
}
