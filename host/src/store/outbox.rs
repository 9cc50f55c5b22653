//! The transactional outbox (the guide's Step 6): a plugin's `outbox` effect becomes a row of
//! `idem_outbox` written in the message's transaction, and a relay delivers pending rows to
//! their destination (an AMQP exchange with publisher confirms, or an HTTP endpoint with an
//! `Idempotency-Key` header).
//!
//! Architecture invariant: a row exists only if its message's transaction committed, and a
//! row is marked delivered only after its destination confirmed. Delivery is at least once:
//! a relay that dies between the destination's confirmation and its own commit delivers the
//! row again, with the same idempotency key, so the destination can drop the repeat.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use sqlx::{PgPool, Row};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;
use crate::config::{AmqpConfig, Destination, OutboxConfig, redact_url};
use crate::effect::OutboxMessage;
use crate::metrics::Metrics;
use crate::source::rabbitmq;

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

/// Written once per (destination, idempotency key): a repeat of the same row, from a
/// pipeline without a claim, changes nothing. Run inside the message's transaction
/// (`ledger`): `$1` the consumer, `$2` the message's key, then the row's fields in order.
pub(crate) const INSERT_SQL: &str = "INSERT INTO idem_outbox \
     (consumer, message_key, destination, idempotency_key, payload, headers) \
     VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT ON CONSTRAINT idem_outbox_once DO NOTHING";

/// Pending rows this relay may take; rows another relay holds are skipped, not waited for.
const TAKE_SQL: &str = "SELECT id, destination, idempotency_key, payload, headers, attempts \
     FROM idem_outbox \
     WHERE delivered_at IS NULL AND parked_at IS NULL AND next_attempt_at <= now() \
     ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

const DELIVERED_SQL: &str = "UPDATE idem_outbox SET delivered_at = now(), attempts = attempts + 1, last_error = NULL \
     WHERE id = $1";

/// A failed attempt: try again after `$3` seconds, or park the row when `$4` is true.
const FAILED_SQL: &str = "UPDATE idem_outbox SET attempts = attempts + 1, last_error = $2, \
       next_attempt_at = now() + make_interval(secs => $3), \
       parked_at = CASE WHEN $4 THEN now() END \
     WHERE id = $1";

const CLEAN_SQL: &str = "DELETE FROM idem_outbox WHERE id IN \
     (SELECT id FROM idem_outbox WHERE delivered_at < now() - make_interval(secs => $1) LIMIT $2)";

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

/// Wakes the relay when this host committed outbox rows, so it need not wait for its poll.
#[derive(Debug, Clone, Default)]
pub struct RelayWaker(Arc<Notify>);

impl RelayWaker {
    pub fn wake(&self) {
        self.0.notify_one();
    }
}

/// One pending row as the relay took it.
struct Pending {
    id: i64,
    destination: String,
    idempotency_key: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    attempts: i32,
}

/// A destination's settings that cannot work: the host does not start.
#[derive(Debug, thiserror::Error)]
#[error("outbox.destinations.{destination}.{key}: {reason}")]
pub struct DestinationError {
    destination: String,
    key: &'static str,
    reason: String,
}

/// One HTTP client per HTTP destination, trusting the destination's `ca_file` alone when it
/// has one (the system's roots otherwise).
pub fn http_clients(
    config: &OutboxConfig,
) -> Result<BTreeMap<String, reqwest::Client>, DestinationError> {
    let mut clients = BTreeMap::new();
    for (name, destination) in &config.destinations {
        let Destination::Http { ca_file, .. } = destination else {
            continue;
        };
        let failed = |key, reason: String| DestinationError {
            destination: name.clone(),
            key,
            reason,
        };
        // A redirect is not a delivery: following it would turn the POST into a GET to
        // somewhere else (a login page) and read its 200 as a confirmation. A 3xx is a
        // failed attempt, with the Location in the row's last error.
        let mut builder = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none());
        if let Some(ca_file) = ca_file {
            let pem = std::fs::read(ca_file).map_err(|error| {
                failed(
                    "ca_file",
                    format!("cannot read {}: {error}", ca_file.display()),
                )
            })?;
            let authorities = reqwest::Certificate::from_pem_bundle(&pem)
                .ok()
                .filter(|authorities| !authorities.is_empty())
                .ok_or_else(|| {
                    failed(
                        "ca_file",
                        format!("{} holds no PEM certificate", ca_file.display()),
                    )
                })?;
            builder = builder.tls_certs_only(authorities);
        }
        let client = builder
            .build()
            .map_err(|error| failed("url", error_chain(&error)))?;
        clients.insert(name.clone(), client);
    }
    Ok(clients)
}

/// Delivers pending rows until `shutdown`; several hosts may run it on the same database.
pub fn spawn_relay(
    config: OutboxConfig,
    http: BTreeMap<String, reqwest::Client>,
    pool: PgPool,
    metrics: Arc<Metrics>,
    waker: RelayWaker,
    shutdown: CancellationToken,
) {
    tokio::spawn(async move {
        let mut relay = Relay {
            config,
            pool,
            metrics,
            http,
            amqp: None,
        };
        info!(
            destinations = relay.config.destinations.len(),
            "Outbox relay started."
        );
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let mut last_clean = tokio::time::Instant::now();
        loop {
            let pause = match relay.pass().await {
                Ok(taken) if taken > 0 => {
                    backoff.reset();
                    None
                }
                Ok(_) => {
                    backoff.reset();
                    Some(relay.config.poll)
                }
                Err(error) => {
                    let delay = backoff.next_delay();
                    warn!(%error, retry_in_ms = delay.as_millis() as u64, "Outbox relay cannot reach PostgreSQL; retrying.");
                    Some(delay)
                }
            };
            if last_clean.elapsed() >= CLEAN_EVERY {
                last_clean = tokio::time::Instant::now();
                match clean(&relay.pool, relay.config.retention).await {
                    Ok(deleted) if deleted > 0 => {
                        info!(deleted, "Outbox: delivered rows past retention removed.");
                    }
                    Ok(_) => {}
                    Err(error) => warn!(%error, "Outbox cleaning failed; will try again."),
                }
            }
            if let Some(pause) = pause {
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = waker.0.notified() => {}
                    () = shutdown.cancelled() => break,
                }
            }
            if shutdown.is_cancelled() {
                break;
            }
        }
        if let Some((_, connection, _)) = relay.amqp.take() {
            let _ = connection.close(200, "idem relay stopping".into()).await;
        }
        debug!("Outbox relay stopped.");
    });
}

/// How often the relay deletes delivered rows past the retention window.
const CLEAN_EVERY: Duration = Duration::from_secs(600);

struct Relay {
    config: OutboxConfig,
    pool: PgPool,
    metrics: Arc<Metrics>,
    /// By destination name.
    http: BTreeMap<String, reqwest::Client>,
    /// The connection to the broker of AMQP destinations, once one was used.
    amqp: Option<(AmqpConfig, Connection, Channel)>,
}

impl Relay {
    /// Takes one batch, delivers it, records the results, commits. Returns the rows taken.
    async fn pass(&mut self) -> Result<usize, sqlx::Error> {
        // The transaction idles while a destination answers (up to its timeout per row), so
        // the host sessions' idle-in-transaction limit does not apply to it; the server's
        // keepalives still end it if this host vanishes.
        let mut transaction = self
            .pool
            .begin_with("BEGIN; SET LOCAL idle_in_transaction_session_timeout = 0")
            .await?;
        let rows = sqlx::query(TAKE_SQL)
            .bind(i64::from(self.config.batch_size.get()))
            .fetch_all(&mut *transaction)
            .await?;
        let mut pending = Vec::with_capacity(rows.len());
        for row in rows {
            let headers: serde_json::Value = row.try_get("headers")?;
            pending.push(Pending {
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
            });
        }
        for row in &pending {
            let result = self.deliver(row).await;
            match result {
                Ok(()) => {
                    sqlx::query(DELIVERED_SQL)
                        .bind(row.id)
                        .execute(&mut *transaction)
                        .await?;
                    self.metrics.outbox_delivered(&row.destination, "delivered");
                }
                Err(error) => {
                    let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
                    let park = attempts >= self.config.max_attempts.get();
                    let delay = retry_delay(attempts);
                    if park {
                        warn!(id = row.id, destination = %row.destination, key = %row.idempotency_key, attempts, %error, "Outbox row parked after its last attempt.");
                    } else {
                        debug!(id = row.id, destination = %row.destination, attempts, %error, "Outbox delivery failed; will retry.");
                    }
                    sqlx::query(FAILED_SQL)
                        .bind(row.id)
                        .bind(&error)
                        .bind(delay.as_secs_f64())
                        .bind(park)
                        .execute(&mut *transaction)
                        .await?;
                    self.metrics
                        .outbox_delivered(&row.destination, if park { "parked" } else { "failed" });
                }
            }
        }
        transaction.commit().await?;
        Ok(pending.len())
    }

    /// Hands one row to its destination; `Ok` only once the destination confirmed it.
    async fn deliver(&mut self, row: &Pending) -> Result<(), String> {
        let Some(destination) = self.config.destinations.get(&row.destination).cloned() else {
            return Err(format!(
                "destination {:?} is not configured in [outbox.destinations]",
                row.destination
            ));
        };
        match destination {
            Destination::Http { url, timeout, .. } => {
                let client = self.http.get(&row.destination).ok_or_else(|| {
                    format!("destination {:?} has no HTTP client", row.destination)
                })?;
                let mut request = client
                    .post(&url)
                    .timeout(timeout)
                    .header("Idempotency-Key", &row.idempotency_key);
                let has_content_type = row
                    .headers
                    .iter()
                    .any(|(name, _)| name.eq_ignore_ascii_case("content-type"));
                if !has_content_type {
                    request = request.header("Content-Type", "application/octet-stream");
                }
                for (name, value) in &row.headers {
                    request = request.header(name, value);
                }
                let response = request
                    .body(row.payload.clone())
                    .send()
                    .await
                    .map_err(|error| {
                        format!("POST {}: {}", redact_url(&url), error_chain(&error))
                    })?;
                if response.status().is_success() {
                    Ok(())
                } else if response.status().is_redirection() {
                    let location = response
                        .headers()
                        .get(reqwest::header::LOCATION)
                        .and_then(|location| location.to_str().ok())
                        .unwrap_or("no Location");
                    Err(format!(
                        "POST {} answered {} (to {}): a redirect is not a delivery; point the destination's url at the final endpoint",
                        redact_url(&url),
                        response.status(),
                        redact_url(location)
                    ))
                } else {
                    Err(format!(
                        "POST {} answered {}",
                        redact_url(&url),
                        response.status()
                    ))
                }
            }
            Destination::Amqp {
                broker,
                exchange,
                routing_key,
            } => {
                let channel = self.amqp_channel(&broker).await?;
                let mut headers = FieldTable::default();
                for (name, value) in &row.headers {
                    headers.insert(
                        ShortString::from(name.as_str()),
                        AMQPValue::LongString(value.as_str().into()),
                    );
                }
                headers.insert(
                    "idempotency-key".into(),
                    AMQPValue::LongString(row.idempotency_key.as_str().into()),
                );
                let properties = BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(row.idempotency_key.as_str().into())
                    .with_headers(headers);
                let published = async {
                    channel
                        .basic_publish(
                            exchange.as_str().into(),
                            routing_key.as_str().into(),
                            BasicPublishOptions {
                                mandatory: true,
                                ..BasicPublishOptions::default()
                            },
                            &row.payload,
                            properties,
                        )
                        .await?
                        .await
                }
                .await;
                match published {
                    Ok(Confirmation::Ack(None)) => Ok(()),
                    Ok(Confirmation::Ack(Some(_returned))) => Err(format!(
                        "exchange {exchange:?} routed the message to no queue (routing key {routing_key:?})"
                    )),
                    Ok(other) => Err(format!(
                        "broker refused the message on {exchange:?}: {other:?}"
                    )),
                    Err(error) => {
                        self.amqp = None;
                        Err(format!("publish to exchange {exchange:?}: {error}"))
                    }
                }
            }
        }
    }

    /// A channel with publisher confirms on `broker`: the one open, or a new one.
    async fn amqp_channel(&mut self, broker: &AmqpConfig) -> Result<Channel, String> {
        if let Some((open_on, connection, channel)) = &self.amqp
            && open_on == broker
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        if let Some((_, connection, _)) = self.amqp.take() {
            let _ = connection
                .close(200, "idem relay changes broker".into())
                .await;
        }
        let (connection, channel) = rabbitmq::connect_channel(broker, "outbox relay")
            .await
            .map_err(|error| error.to_string())?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|error| format!("enable publisher confirms for the outbox: {error}"))?;
        self.amqp = Some((broker.clone(), connection, channel.clone()));
        Ok(channel)
    }
}

/// An error with its causes, which for a TLS failure name the certificate problem.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Seconds until attempt `attempts + 1`: 1 s doubling to 5 minutes.
fn retry_delay(attempts: u32) -> Duration {
    let factor = 1u64
        .checked_shl(attempts.saturating_sub(1).min(16))
        .unwrap_or(u64::MAX);
    Duration::from_secs(factor).min(Duration::from_secs(300))
}

/// Deletes delivered rows older than `retention`, in batches. Returns the rows deleted.
pub async fn clean(pool: &PgPool, retention: Duration) -> Result<u64, sqlx::Error> {
    let mut deleted = 0;
    loop {
        let batch = sqlx::query(CLEAN_SQL)
            .bind(retention.as_secs_f64())
            .bind(10_000_i64)
            .execute(pool)
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
pub async fn backlog(pool: &PgPool) -> Result<Backlog, sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) FILTER (WHERE delivered_at IS NULL AND parked_at IS NULL) AS pending, \
                count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked, \
                count(*) FILTER (WHERE delivered_at IS NOT NULL) AS delivered \
         FROM idem_outbox",
    )
    .fetch_one(pool)
    .await?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        parked: row.try_get("parked")?,
        delivered: row.try_get("delivered")?,
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
    parked_only: bool,
    limit: i64,
) -> Result<Vec<Undelivered>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, consumer, destination, idempotency_key, attempts, last_error, \
                extract(epoch FROM now() - created_at)::float8 AS age_seconds, \
                parked_at IS NOT NULL AS parked \
         FROM idem_outbox \
         WHERE delivered_at IS NULL AND (parked_at IS NOT NULL OR NOT $1) \
         ORDER BY id LIMIT $2",
    )
    .bind(parked_only)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Unparks the parked rows of `destination` (all when `None`), or only row `id`: they are
/// pending again with a full set of attempts, and a running relay delivers them on its next
/// pass. Returns the ids unparked.
pub async fn retry_parked(
    pool: &PgPool,
    destination: Option<&str>,
    id: Option<i64>,
) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE idem_outbox SET parked_at = NULL, attempts = 0, next_attempt_at = now() \
         WHERE parked_at IS NOT NULL AND delivered_at IS NULL \
           AND ($1::text IS NULL OR destination = $1) AND ($2::int8 IS NULL OR id = $2) \
         RETURNING id",
    )
    .bind(destination)
    .bind(id)
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delay_doubles_then_caps() {
        assert_eq!(retry_delay(1), Duration::from_secs(1));
        assert_eq!(retry_delay(2), Duration::from_secs(2));
        assert_eq!(retry_delay(5), Duration::from_secs(16));
        assert_eq!(retry_delay(30), Duration::from_secs(300));
    }
}
