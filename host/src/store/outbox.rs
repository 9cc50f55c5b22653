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

use crate::config::{Destination, OutboxConfig};
use crate::effect::{MAX_KEY_BYTES, OutboxMessage};
use crate::telemetry::traces::TraceContext;

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
    /// A key no destination could carry: too long for the index or the AMQP `message-id`,
    /// or with a control character no header may hold.
    #[error("outbox effect's idempotency key {reason}")]
    Key { reason: String },
    /// A header no HTTP request or AMQP message could carry.
    #[error("outbox effect's header {name:?} {reason}")]
    Header { name: String, reason: &'static str },
}

/// The longest AMQP short string: a `message-id`, a header's name.
const AMQP_SHORT_STRING: usize = 255;

/// Why `key` cannot be an outbox row's idempotency key for `destination`, if it cannot:
/// it is sent as `Idempotency-Key` (HTTP) or `message-id` (AMQP).
fn key_problem(key: &str, destination: &Destination) -> Option<String> {
    let limit = match destination {
        Destination::Amqp { .. } => AMQP_SHORT_STRING,
        Destination::Http { .. } => MAX_KEY_BYTES,
    };
    if key.len() > limit {
        Some(format!("has {} bytes, limit is {limit}", key.len()))
    } else if key.chars().any(char::is_control) {
        Some("holds a control character".to_string())
    } else {
        None
    }
}

/// Why a header `name: value` cannot be sent, if it cannot: a name must be an HTTP token
/// (and an AMQP short string), a value free of control characters but the tab.
fn header_problem(name: &str, value: &str) -> Option<&'static str> {
    let token = |byte: u8| byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte);
    if name.is_empty() || name.len() > AMQP_SHORT_STRING || !name.bytes().all(token) {
        Some("is not a header name (letters, digits and !#$%&'*+-.^_`|~, at most 255 bytes)")
    } else if value.chars().any(|c| c.is_control() && c != '\t') {
        Some("has a value with a control character")
    } else {
        None
    }
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
        let Some(destination) = known.and_then(|known| known.get(&message.destination)) else {
            return Err(OutboxError::UnknownDestination {
                destination: message.destination.clone(),
                known: known
                    .map(|known| known.keys().cloned().collect::<Vec<_>>().join(", "))
                    .filter(|names| !names.is_empty())
                    .unwrap_or_else(|| "none; add an [outbox.destinations.<name>] table".into()),
            });
        };
        let idempotency_key = message
            .key
            .clone()
            .unwrap_or_else(|| message_key.to_string());
        if idempotency_key.is_empty() {
            return Err(OutboxError::EmptyKey);
        }
        if let Some(reason) = key_problem(&idempotency_key, destination) {
            return Err(OutboxError::Key { reason });
        }
        for (name, value) in &message.headers {
            if let Some(reason) = header_problem(name, value) {
                return Err(OutboxError::Header {
                    name: name.chars().take(64).collect(),
                    reason,
                });
            }
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
            // Parsed again: a row written before contexts were parsed may carry a producer's
            // raw tracestate, which no header could send.
            trace: match row.try_get::<Option<String>, _>("traceparent")? {
                Some(traceparent) => TraceContext::parsed(
                    &traceparent,
                    row.try_get::<Option<String>, _>("tracestate")?.as_deref(),
                ),
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
) -> Result<crate::telemetry::metrics::OutboxSample, sqlx::Error> {
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
    Ok(crate::telemetry::metrics::OutboxSample {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys and headers no destination could carry are refused when the row is planned
    /// (the message's fault, dead-lettered), not parked after every delivery failed.
    #[test]
    fn rows_no_destination_could_carry_are_refused() {
        let http = Destination::Http {
            url: "http://127.0.0.1/receipts".into(),
            timeout: Duration::from_secs(1),
            ca_file: None,
        };
        assert_eq!(key_problem("receipt:1", &http), None);
        assert_eq!(key_problem("заказ:1", &http), None);
        assert!(key_problem("a\nb", &http).is_some());
        assert!(key_problem("a\u{7f}", &http).is_some());
        assert!(key_problem(&"k".repeat(MAX_KEY_BYTES + 1), &http).is_some());
        assert_eq!(key_problem(&"k".repeat(MAX_KEY_BYTES), &http), None);
        assert_eq!(header_problem("content-type", "application/json"), None);
        assert_eq!(header_problem("x-note", "a\tb"), None);
        for (name, value) in [
            ("", "v"),
            ("bad name", "v"),
            ("x-ok", "line\r\nInjected: yes"),
            ("x-ok", "\u{1}"),
            ("é", "v"),
        ] {
            assert!(header_problem(name, value).is_some(), "{name:?}: {value:?}");
        }
        assert!(header_problem(&"h".repeat(256), "v").is_some());
    }
}
