//! Operator pauses that last: recorded on the consumer's row of `idem_consumers`
//! (`paused_at`, `pause_reason`), where every host of the consumer reads them (`pipeline::pause`
//! polls them), across restarts, until a resume clears them.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use sqlx::PgPool;

use crate::store::bookkeeping;
use crate::store::tables::Tables;

/// A recorded pause: why, and since when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub reason: String,
    pub since: SystemTime,
}

/// Records that `consumer` (retention window `window`, for a row not there yet) is paused.
pub async fn record(
    pool: &PgPool,
    tables: &Tables,
    consumer: &str,
    window: Duration,
    reason: &str,
) -> Result<(), sqlx::Error> {
    bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query(&tables.sql(
            "INSERT INTO {consumers} (consumer, retention_window, paused_at, pause_reason) \
             VALUES ($1, make_interval(secs => $2), now(), $3) \
             ON CONFLICT (consumer) DO UPDATE \
               SET paused_at = coalesce({consumers}.paused_at, now()), pause_reason = $3",
        ))
        .bind(consumer)
        .bind(window.as_secs_f64())
        .bind(reason)
        .execute(connection)
        .await
    })
    .await
    .map(drop)
}

/// Clears `consumer`'s recorded pause; whether there was one.
pub async fn clear(pool: &PgPool, tables: &Tables, consumer: &str) -> Result<bool, sqlx::Error> {
    let cleared = bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query(&tables.sql(
            "UPDATE {consumers} SET paused_at = NULL, pause_reason = NULL \
             WHERE consumer = $1 AND paused_at IS NOT NULL",
        ))
        .bind(consumer)
        .execute(connection)
        .await
    })
    .await?;
    Ok(cleared.rows_affected() > 0)
}

/// Every paused consumer of the database.
pub async fn recorded(
    pool: &PgPool,
    tables: &Tables,
) -> Result<BTreeMap<String, Recorded>, sqlx::Error> {
    let rows: Vec<(String, Option<String>, f64)> =
        bookkeeping::in_transaction(pool, async |connection| {
            bookkeeping::query_as(&tables.sql(
                "SELECT consumer, pause_reason, extract(epoch FROM paused_at)::float8 \
                 FROM {consumers} WHERE paused_at IS NOT NULL",
            ))
            .fetch_all(connection)
            .await
        })
        .await?;
    Ok(rows
        .into_iter()
        .map(|(consumer, reason, since)| {
            let since = SystemTime::UNIX_EPOCH + Duration::from_secs_f64(since.max(0.0));
            let reason = reason.unwrap_or_default();
            (consumer, Recorded { reason, since })
        })
        .collect())
}
