//! The transactional outbox's table (the guide's Step 6): a plugin's `outbox` effect becomes
//! a row of `idem_outbox` written in the message's transaction (`ledger`); the relay
//! (`crate::relay`) takes pending rows and records each attempt here; operators list and
//! unpark them.
//!
//! Architecture invariant: a row exists only if its message's transaction committed.

use std::num::NonZeroU32;
use std::time::Duration;

use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::store::bookkeeping;
use crate::store::tables::Tables;

use crate::config::OutboxConfig;
use crate::effect::OutboxMessage;
use crate::traces::TraceContext;

/// Rows of one message's outbox effects, checked against the configured destinations.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    pub destination: String,
    pub idempotency_key: String,
    pub payload: Vec<u8>,
    /// The message's headers as the JSON object the row stores.
    pub headers: serde_json::Value,
}

/// An outbox effect the host cannot accept: the message is dead-lettered, nothing runs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OutboxError {
    #[error("outbox effect names unknown destination {destination:?} (configured: {known})")]
    UnknownDestination { destination: String, known: String },
    #[error("outbox effect has an empty idempotency key")]
    EmptyKey,
}

/// Pending rows this relay may take; rows another relay holds are skipped, not waited for.
const TAKE_SQL: &str = "SELECT id, destination, idempotency_key, payload, headers, attempts, \
       traceparent, tracestate \
     FROM {outbox} \
     WHERE delivered_at IS NULL AND parked_at IS NULL AND next_attempt_at <= now() \
     ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

const DELIVERED_SQL: &str = "UPDATE {outbox} SET delivered_at = now(), attempts = attempts + 1, last_error = NULL \
     WHERE id = $1";

/// A failed attempt: try again after `$3` seconds, or park the row when `$4` is true.
const FAILED_SQL: &str = "UPDATE {outbox} SET attempts = attempts + 1, last_error = $2, \
       next_attempt_at = now() + make_interval(secs => $3), \
       parked_at = CASE WHEN $4 THEN now() END \
     WHERE id = $1";

const CLEAN_SQL: &str = "DELETE FROM {outbox} WHERE id IN \
     (SELECT id FROM {outbox} WHERE delivered_at < now() - make_interval(secs => $1) LIMIT $2)";

impl OutboxRow {
    /// Checks an outbox effect against the configured destinations; the key defaults to the
    /// message's idempotency key.
    pub fn from_effect(
        message: &OutboxMessage,
        message_key: &str,
        config: Option<&OutboxConfig>,
    ) -> Result<OutboxRow, OutboxError> {
        let known = config.map(|config| &config.destinations);
        if !known.is_some_and(|known| known.contains_key(&message.destination)) {
            return Err(OutboxError::UnknownDestination {
                destination: message.destination.clone(),
                known: known
                    .map(|known| known.keys().cloned().collect::<Vec<_>>().join(", "))
                    .filter(|names| !names.is_empty())
                    .unwrap_or_else(|| "none; add an [outbox.destinations.<name>] table".into()),
            });
        }
        let idempotency_key = message
            .key
            .clone()
            .unwrap_or_else(|| message_key.to_string());
        if idempotency_key.is_empty() {
            return Err(OutboxError::EmptyKey);
        }
        Ok(OutboxRow {
            destination: message.destination.clone(),
            idempotency_key,
            payload: message.payload.clone(),
            headers: serde_json::Value::Object(
                message
                    .headers
                    .iter()
                    .map(|(name, value)| (name.clone(), serde_json::Value::String(value.clone())))
                    .collect(),
            ),
        })
    }
}

/// One pending row as the relay took it.
#[derive(Debug, Clone)]
pub struct Taken {
    pub id: i64,
    pub destination: String,
    pub idempotency_key: String,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// Attempts made before this one.
    pub attempts: i32,
    /// The trace context of the message span that wrote it.
    pub trace: Option<TraceContext>,
}

/// How one attempt at a row ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempt {
    /// The destination confirmed it.
    Delivered,
    /// It did not: try again after `retry_in`, or never again (`park`) until an operator
    /// unparks it.
    Failed {
        error: String,
        retry_in: Duration,
        park: bool,
    },
}

/// Opens the relay's transaction and takes up to `batch` pending rows that are due, skipping
/// rows another relay holds. The transaction idles while destinations answer (up to their
/// timeout per row), so the host sessions' idle-in-transaction limit does not apply to it;
/// the server's keepalives still end it if this host vanishes.
pub async fn take(
    pool: &PgPool,
    tables: &Tables,
    batch: NonZeroU32,
) -> Result<(Transaction<'static, Postgres>, Vec<Taken>), sqlx::Error> {
    let mut transaction =
        bookkeeping::begin(pool, "SET LOCAL idle_in_transaction_session_timeout = 0").await?;
    let rows = bookkeeping::query(&tables.sql(TAKE_SQL))
        .bind(i64::from(batch.get()))
        .fetch_all(&mut *transaction)
        .await?;
    let mut taken = Vec::with_capacity(rows.len());
    for row in rows {
        let headers: serde_json::Value = row.try_get("headers")?;
        taken.push(Taken {
            id: row.try_get("id")?,
            destination: row.try_get("destination")?,
            idempotency_key: row.try_get("idempotency_key")?,
            payload: row.try_get("payload")?,
            headers: headers
                .as_object()
                .map(|object| {
                    object
                        .iter()
                        .map(|(name, value)| {
                            (name.clone(), value.as_str().unwrap_or_default().to_string())
                        })
                        .collect()
                })
                .unwrap_or_default(),
            attempts: row.try_get("attempts")?,
            trace: match row.try_get::<Option<String>, _>("traceparent")? {
                Some(traceparent) => Some(TraceContext {
                    traceparent,
                    tracestate: row.try_get("tracestate")?,
                }),
                None => None,
            },
        });
    }
    Ok((transaction, taken))
}

/// Records how an attempt at row `id` ended, in the relay's transaction.
pub async fn record(
    transaction: &mut Transaction<'static, Postgres>,
    tables: &Tables,
    id: i64,
    attempt: &Attempt,
) -> Result<(), sqlx::Error> {
    match attempt {
        Attempt::Delivered => {
            bookkeeping::query(&tables.sql(DELIVERED_SQL))
                .bind(id)
                .execute(&mut **transaction)
                .await?;
        }
        Attempt::Failed {
            error,
            retry_in,
            park,
        } => {
            bookkeeping::query(&tables.sql(FAILED_SQL))
                .bind(id)
                .bind(error)
                .bind(retry_in.as_secs_f64())
                .bind(park)
                .execute(&mut **transaction)
                .await?;
        }
    }
    Ok(())
}

/// Deletes delivered rows older than `retention`, in batches. Returns the rows deleted.
pub async fn clean(
    pool: &PgPool,
    tables: &Tables,
    retention: Duration,
) -> Result<u64, sqlx::Error> {
    let mut deleted = 0;
    loop {
        let batch = bookkeeping::in_transaction(pool, async |connection| {
            bookkeeping::query(&tables.sql(CLEAN_SQL))
                .bind(retention.as_secs_f64())
                .bind(10_000_i64)
                .execute(connection)
                .await
        })
        .await?
        .rows_affected();
        deleted += batch;
        if batch == 0 {
            return Ok(deleted);
        }
    }
}

/// Outbox rows by state, for `idem status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    pub pending: i64,
    pub parked: i64,
    pub delivered: i64,
}

/// Counts the outbox rows by state.
pub async fn backlog(pool: &PgPool, tables: &Tables) -> Result<Backlog, sqlx::Error> {
    let row = bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query(&tables.sql(
            "SELECT count(*) FILTER (WHERE delivered_at IS NULL AND parked_at IS NULL) AS pending, \
                    count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked, \
                    count(*) FILTER (WHERE delivered_at IS NOT NULL) AS delivered \
             FROM {outbox}",
        ))
        .fetch_one(connection)
        .await
    })
    .await?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        parked: row.try_get("parked")?,
        delivered: row.try_get("delivered")?,
    })
}

/// The outbox's rows not delivered and its oldest pending one's age, for the sampled gauges:
/// the pending rows through their partial index, the parked ones (few) by a scan.
pub async fn undelivered_sample(
    pool: &PgPool,
    tables: &Tables,
) -> Result<crate::metrics::OutboxSample, sqlx::Error> {
    let (pending, parked, oldest): (i64, i64, Option<f64>) =
        bookkeeping::in_transaction(pool, async |connection| {
            bookkeeping::query_as(&tables.sql(
                "SELECT (SELECT count(*) FROM {outbox} WHERE delivered_at IS NULL AND parked_at IS NULL), \
                        (SELECT count(*) FROM {outbox} WHERE parked_at IS NOT NULL), \
                        (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {outbox} \
                          WHERE delivered_at IS NULL AND parked_at IS NULL)",
            ))
            .fetch_one(connection)
            .await
        })
        .await?;
    Ok(crate::metrics::OutboxSample {
        pending,
        parked,
        oldest_pending_age: Duration::from_secs_f64(oldest.unwrap_or(0.0).max(0.0)),
    })
}

/// An undelivered outbox row, for `idem outbox list`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Undelivered {
    pub id: i64,
    pub consumer: String,
    pub destination: String,
    pub idempotency_key: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// Seconds since the row was written.
    pub age_seconds: f64,
    pub parked: bool,
}

impl Undelivered {
    /// The row as `idem outbox list --json` and the console show it.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "state": if self.parked { "parked" } else { "pending" },
            "consumer": self.consumer,
            "destination": self.destination,
            "key": self.idempotency_key,
            "attempts": self.attempts,
            "age_seconds": self.age_seconds.round() as i64,
            "last_error": self.last_error,
        })
    }
}

/// Undelivered rows, oldest first: parked ones only when `parked_only`.
pub async fn undelivered(
    pool: &PgPool,
    tables: &Tables,
    parked_only: bool,
    limit: i64,
) -> Result<Vec<Undelivered>, sqlx::Error> {
    bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query_as(&tables.sql(
            "SELECT id, consumer, destination, idempotency_key, attempts, last_error, \
                    extract(epoch FROM now() - created_at)::float8 AS age_seconds, \
                    parked_at IS NOT NULL AS parked \
             FROM {outbox} \
             WHERE delivered_at IS NULL AND (parked_at IS NOT NULL OR NOT $1) \
             ORDER BY id LIMIT $2",
        ))
        .bind(parked_only)
        .bind(limit)
        .fetch_all(connection)
        .await
    })
    .await
}

/// Unparks the parked rows of `destination` (all when `None`), or only row `id`: they are
/// pending again with a full set of attempts, and a running relay delivers them on its next
/// pass. Returns the ids unparked.
pub async fn retry_parked(
    pool: &PgPool,
    tables: &Tables,
    destination: Option<&str>,
    id: Option<i64>,
) -> Result<Vec<i64>, sqlx::Error> {
    bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query_scalar(&tables.sql(
            "UPDATE {outbox} SET parked_at = NULL, attempts = 0, next_attempt_at = now() \
             WHERE parked_at IS NOT NULL AND delivered_at IS NULL \
               AND ($1::text IS NULL OR destination = $1) AND ($2::int8 IS NULL OR id = $2) \
             RETURNING id",
        ))
        .bind(destination)
        .bind(id)
        .fetch_all(connection)
        .await
    })
    .await
}
