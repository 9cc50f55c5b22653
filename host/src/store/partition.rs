//! Partition mode: `processed_messages` partitioned by day on `processed_at`, so retention
//! drops whole partitions instead of deleting rows (no vacuum load, no WAL burst).
//!
//! A partitioned table's unique index must include the partition key, so it can no longer
//! refuse the same `(consumer, message_key)` claimed on two different days. The claim then
//! takes a transaction-scoped advisory lock on the key and checks every partition before it
//! inserts (see `ledger`): duplicates still serialise, and a rolled-back first claimer still
//! lets the waiting duplicate apply.
//!
//! The mode is a property of the table: `idem partition` converts it, and the host reads it
//! at start-up.

use chrono::{Duration as ChronoDuration, NaiveDate, Utc};
use sqlx::{PgPool, Postgres, Transaction};

use crate::store::bookkeeping;
use crate::store::tables::Tables;

/// The partition that takes claims of a day without a partition of its own.
pub const DEFAULT_PARTITION: &str = "processed_messages_default";

/// Days of partitions created ahead of today.
pub const DAYS_AHEAD: i64 = 3;

/// What a maintenance pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Maintenance {
    pub created: Vec<String>,
    pub dropped: Vec<String>,
    /// Rows in the default partition: claims whose day had no partition (should be 0).
    pub stray_rows: i64,
}

/// True when `processed_messages` is a partitioned table.
pub async fn is_partitioned(pool: &PgPool, tables: &Tables) -> Result<bool, sqlx::Error> {
    bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query_scalar(&tables.sql(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid \
             WHERE c.relname = 'processed_messages' AND c.relnamespace = \
               (SELECT oid FROM pg_namespace WHERE nspname = {schema}))",
        ))
        .fetch_one(connection)
        .await
    })
    .await
}

/// Converts a plain `processed_messages` into a table partitioned by day, keeping every claim,
/// in one transaction (it locks the table while it copies: run it before starting hosts).
/// Returns false if the table was already partitioned.
pub async fn convert(pool: &PgPool, tables: &Tables) -> Result<Conversion, sqlx::Error> {
    if is_partitioned(pool, tables).await? {
        return Ok(Conversion::AlreadyPartitioned);
    }
    let mut transaction = bookkeeping::begin(pool, "").await?;
    // A running host keeps the claim form it read at start; after the conversion its
    // `ON CONFLICT DO NOTHING` would never conflict. Refuse while any host is connected.
    let hosts: i64 = bookkeeping::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'idem' AND pid <> pg_backend_pid()",
    )
    .fetch_one(&mut *transaction)
    .await?;
    if hosts > 0 {
        return Ok(Conversion::HostsConnected { sessions: hosts });
    }
    let unpartitioned = tables.qualified("processed_messages_unpartitioned");
    // The table set aside under another name, and its partitioned successor in its place.
    let replace = [
        tables.sql("LOCK TABLE {claims} IN ACCESS EXCLUSIVE MODE"),
        tables.sql("ALTER TABLE {claims} RENAME TO processed_messages_unpartitioned"),
        format!(
            "ALTER INDEX {} RENAME TO processed_messages_unpartitioned_time",
            tables.qualified("processed_messages_time")
        ),
        format!(
            "ALTER TABLE {unpartitioned} RENAME CONSTRAINT processed_messages_pkey \
             TO processed_messages_unpartitioned_pkey",
        ),
        tables.sql(
            "CREATE TABLE {claims} ( \
               consumer      text        NOT NULL, \
               message_key   text        NOT NULL, \
               processed_at  timestamptz NOT NULL DEFAULT now(), \
               plugin_digest text, \
               PRIMARY KEY (consumer, message_key, processed_at) \
             ) PARTITION BY RANGE (processed_at)",
        ),
        tables.sql("CREATE INDEX processed_messages_time ON {claims} (processed_at)"),
        format!(
            "CREATE TABLE {} PARTITION OF {} DEFAULT",
            tables.qualified(DEFAULT_PARTITION),
            tables.claims()
        ),
    ];
    for statement in &replace {
        bookkeeping::query(statement)
            .execute(&mut *transaction)
            .await?;
    }
    let oldest: Option<NaiveDate> = bookkeeping::query_scalar(&format!(
        "SELECT min(processed_at AT TIME ZONE 'UTC')::date FROM {unpartitioned}",
    ))
    .fetch_one(&mut *transaction)
    .await?;
    let today = Utc::now().date_naive();
    let mut day = oldest.unwrap_or(today).min(today);
    while day <= today + ChronoDuration::days(DAYS_AHEAD) {
        create_partition(&mut transaction, tables, day).await?;
        day += ChronoDuration::days(1);
    }
    bookkeeping::query(&format!(
        "INSERT INTO {} (consumer, message_key, processed_at, plugin_digest) \
         SELECT consumer, message_key, processed_at, plugin_digest FROM {unpartitioned}",
        tables.claims()
    ))
    .execute(&mut *transaction)
    .await?;
    bookkeeping::query(&format!("DROP TABLE {unpartitioned}"))
        .execute(&mut *transaction)
        .await?;
    transaction.commit().await?;
    Ok(Conversion::Converted)
}

/// What `convert` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conversion {
    Converted,
    AlreadyPartitioned,
    /// Refused: idem host sessions are connected to the database.
    HostsConnected {
        sessions: i64,
    },
}

/// Creates the partitions of today and the next [`DAYS_AHEAD`] days, and drops every
/// partition that ends before `now() - window`, where `window` is the longest of `window`
/// and every consumer's recorded window (`idem_consumers`): a partition holds every
/// consumer's claims, so it goes only when no consumer sharing the table needs it.
pub async fn maintain(
    pool: &PgPool,
    tables: &Tables,
    window: std::time::Duration,
) -> Result<Maintenance, sqlx::Error> {
    let mut transaction = bookkeeping::begin(pool, "").await?;
    let recorded: Option<f64> = bookkeeping::query_scalar(
        &tables.sql("SELECT extract(epoch FROM max(retention_window))::float8 FROM {consumers}"),
    )
    .fetch_one(&mut *transaction)
    .await?;
    let recorded = recorded
        .filter(|seconds| seconds.is_finite() && *seconds > 0.0)
        .map_or(
            std::time::Duration::ZERO,
            std::time::Duration::from_secs_f64,
        );
    let window = window.max(recorded);
    let mut maintenance = Maintenance::default();
    let existing = partitions(&mut transaction, tables).await?;
    let today = Utc::now().date_naive();
    for offset in 0..=DAYS_AHEAD {
        let day = today + ChronoDuration::days(offset);
        if !existing
            .iter()
            .any(|(_, partition_day)| *partition_day == day)
        {
            maintenance
                .created
                .push(create_partition(&mut transaction, tables, day).await?);
        }
    }
    let window = ChronoDuration::from_std(window).unwrap_or(ChronoDuration::MAX);
    let cutoff = Utc::now()
        .checked_sub_signed(window)
        .map_or(NaiveDate::MIN, |cutoff| cutoff.date_naive());
    for (name, day) in existing {
        // The partition holds [day, day + 1): wholly older than the window when day + 1 <= cutoff.
        if day + ChronoDuration::days(1) <= cutoff {
            bookkeeping::query(&format!("DROP TABLE {}", tables.qualified(&name)))
                .execute(&mut *transaction)
                .await?;
            maintenance.dropped.push(name);
        }
    }
    transaction.commit().await?;
    // Counted after the partitions' locks are released.
    maintenance.stray_rows = bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query_scalar(&format!(
            "SELECT count(*) FROM {}",
            tables.qualified(DEFAULT_PARTITION)
        ))
        .fetch_one(connection)
        .await
    })
    .await?;
    Ok(maintenance)
}

/// The day partitions, by name and first day.
async fn partitions(
    transaction: &mut Transaction<'_, Postgres>,
    tables: &Tables,
) -> Result<Vec<(String, NaiveDate)>, sqlx::Error> {
    let names: Vec<String> = bookkeeping::query_scalar(&tables.sql(
        "SELECT c.relname::text FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent \
         WHERE p.relname = 'processed_messages' AND p.relnamespace = \
           (SELECT oid FROM pg_namespace WHERE nspname = {schema})",
    ))
    .fetch_all(&mut **transaction)
    .await?;
    Ok(names
        .into_iter()
        .filter_map(|name| {
            let day = name.strip_prefix("processed_messages_p")?;
            let day = NaiveDate::parse_from_str(day, "%Y%m%d").ok()?;
            Some((name, day))
        })
        .collect())
}

async fn create_partition(
    transaction: &mut Transaction<'_, Postgres>,
    tables: &Tables,
    day: NaiveDate,
) -> Result<String, sqlx::Error> {
    let name = format!("processed_messages_p{}", day.format("%Y%m%d"));
    let next = day + ChronoDuration::days(1);
    bookkeeping::query(&format!(
        "CREATE TABLE IF NOT EXISTS {} PARTITION OF {} \
         FOR VALUES FROM ('{day} 00:00:00+00') TO ('{next} 00:00:00+00')",
        tables.qualified(&name),
        tables.claims(),
    ))
    .execute(&mut **transaction)
    .await?;
    Ok(name)
}
