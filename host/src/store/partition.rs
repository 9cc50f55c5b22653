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
pub async fn is_partitioned(pool: &PgPool) -> Result<bool, sqlx::Error> {
    bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid \
             WHERE c.relname = 'processed_messages' AND c.relnamespace = current_schema()::regnamespace)",
        )
        .fetch_one(connection)
        .await
    })
    .await
}

/// Converts a plain `processed_messages` into a table partitioned by day, keeping every claim,
/// in one transaction (it locks the table while it copies: run it before starting hosts).
/// Returns false if the table was already partitioned.
pub async fn convert(pool: &PgPool) -> Result<Conversion, sqlx::Error> {
    if is_partitioned(pool).await? {
        return Ok(Conversion::AlreadyPartitioned);
    }
    let mut transaction = pool.begin().await?;
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
    bookkeeping::query("LOCK TABLE processed_messages IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *transaction)
        .await?;
    bookkeeping::query("ALTER TABLE processed_messages RENAME TO processed_messages_unpartitioned")
        .execute(&mut *transaction)
        .await?;
    bookkeeping::query(
        "ALTER INDEX processed_messages_time RENAME TO processed_messages_unpartitioned_time",
    )
    .execute(&mut *transaction)
    .await?;
    bookkeeping::query(
        "ALTER TABLE processed_messages_unpartitioned RENAME CONSTRAINT processed_messages_pkey \
         TO processed_messages_unpartitioned_pkey",
    )
    .execute(&mut *transaction)
    .await?;
    bookkeeping::query(
        "CREATE TABLE processed_messages ( \
           consumer      text        NOT NULL, \
           message_key   text        NOT NULL, \
           processed_at  timestamptz NOT NULL DEFAULT now(), \
           plugin_digest text, \
           PRIMARY KEY (consumer, message_key, processed_at) \
         ) PARTITION BY RANGE (processed_at)",
    )
    .execute(&mut *transaction)
    .await?;
    bookkeeping::query("CREATE INDEX processed_messages_time ON processed_messages (processed_at)")
        .execute(&mut *transaction)
        .await?;
    bookkeeping::query(
        "CREATE TABLE processed_messages_default PARTITION OF processed_messages DEFAULT",
    )
    .execute(&mut *transaction)
    .await?;
    let oldest: Option<NaiveDate> = bookkeeping::query_scalar(
        "SELECT min(processed_at AT TIME ZONE 'UTC')::date FROM processed_messages_unpartitioned",
    )
    .fetch_one(&mut *transaction)
    .await?;
    let today = Utc::now().date_naive();
    let mut day = oldest.unwrap_or(today).min(today);
    while day <= today + ChronoDuration::days(DAYS_AHEAD) {
        create_partition(&mut transaction, day).await?;
        day += ChronoDuration::days(1);
    }
    bookkeeping::query(
        "INSERT INTO processed_messages (consumer, message_key, processed_at, plugin_digest) \
         SELECT consumer, message_key, processed_at, plugin_digest FROM processed_messages_unpartitioned",
    )
    .execute(&mut *transaction)
    .await?;
    bookkeeping::query("DROP TABLE processed_messages_unpartitioned")
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
    window: std::time::Duration,
) -> Result<Maintenance, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let recorded: Option<f64> = bookkeeping::query_scalar(
        "SELECT extract(epoch FROM max(retention_window))::float8 FROM idem_consumers",
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
    let existing = partitions(&mut transaction).await?;
    let today = Utc::now().date_naive();
    for offset in 0..=DAYS_AHEAD {
        let day = today + ChronoDuration::days(offset);
        if !existing
            .iter()
            .any(|(_, partition_day)| *partition_day == day)
        {
            maintenance
                .created
                .push(create_partition(&mut transaction, day).await?);
        }
    }
    let window = ChronoDuration::from_std(window).unwrap_or(ChronoDuration::MAX);
    let cutoff = Utc::now()
        .checked_sub_signed(window)
        .map_or(NaiveDate::MIN, |cutoff| cutoff.date_naive());
    for (name, day) in existing {
        // The partition holds [day, day + 1): wholly older than the window when day + 1 <= cutoff.
        if day + ChronoDuration::days(1) <= cutoff {
            bookkeeping::query(&format!("DROP TABLE \"{name}\""))
                .execute(&mut *transaction)
                .await?;
            maintenance.dropped.push(name);
        }
    }
    transaction.commit().await?;
    // Counted after the partitions' locks are released.
    maintenance.stray_rows = bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query_scalar("SELECT count(*) FROM processed_messages_default")
            .fetch_one(connection)
            .await
    })
    .await?;
    Ok(maintenance)
}

/// The day partitions, by name and first day.
async fn partitions(
    transaction: &mut Transaction<'_, Postgres>,
) -> Result<Vec<(String, NaiveDate)>, sqlx::Error> {
    let names: Vec<String> = bookkeeping::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent \
         WHERE p.relname = 'processed_messages' AND p.relnamespace = current_schema()::regnamespace",
    )
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
    day: NaiveDate,
) -> Result<String, sqlx::Error> {
    let name = format!("processed_messages_p{}", day.format("%Y%m%d"));
    let next = day + ChronoDuration::days(1);
    bookkeeping::query(&format!(
        "CREATE TABLE IF NOT EXISTS \"{name}\" PARTITION OF processed_messages \
         FOR VALUES FROM ('{day} 00:00:00+00') TO ('{next} 00:00:00+00')"
    ))
    .execute(&mut **transaction)
    .await?;
    Ok(name)
}
