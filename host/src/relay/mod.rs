//! The outbox relay (the guide's Step 6): delivers the `idem_outbox` rows that committed
//! transactions wrote (`store::outbox`) to their destinations, an HTTP endpoint (`http`) or
//! an AMQP exchange (`amqp`), and records each attempt on the row.
//!
//! Architecture invariant: a row is marked delivered only after its destination confirmed
//! it. Delivery is at least once: a relay that dies between the destination's confirmation
//! and its own commit delivers the row again, with the same idempotency key, so the
//! destination can drop the repeat. Several hosts may relay the same database: a pass takes
//! its rows with `SKIP LOCKED`.

mod amqp;
mod http;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::backoff::{Backoff, Schedule};
use crate::config::{Destination, OutboxConfig};
use crate::store::database::Database;
use crate::store::outbox::{self, Attempt, Taken};
use crate::store::tables::Tables;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::traces::{self, TraceContext};

pub use http::{DestinationError, http_clients};

/// The waits before a row's next attempt after a failed one: 1 s doubling to 5 minutes.
const RETRIES: Schedule = Schedule::new(Duration::from_secs(1), Duration::from_secs(300));

/// How often the relay deletes delivered rows past the retention window.
const CLEAN_EVERY: Duration = Duration::from_secs(600);

/// Wakes the relay when this host committed outbox rows, so it need not wait for its poll.
#[derive(Debug, Clone, Default)]
pub struct RelayWaker(Arc<Notify>);

impl RelayWaker {
    pub fn wake(&self) {
        self.0.notify_one();
    }
}

/// Why a destination did not confirm a row; the row's `last_error` says it.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("destination {0:?} is not configured in [outbox.destinations]")]
    UnknownDestination(String),
    #[error("destination {0:?} has no HTTP client")]
    NoClient(String),
    /// The endpoint could not be reached or did not answer in time.
    #[error("POST {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error(
        "POST {url} answered {status} (to {location}): a redirect is not a delivery; point the destination's url at the final endpoint"
    )]
    Redirected {
        url: String,
        status: reqwest::StatusCode,
        location: String,
    },
    #[error("POST {url} answered {status}")]
    Refused {
        url: String,
        status: reqwest::StatusCode,
    },
    /// No channel to the broker (an outage, or a refusal naming its setting).
    #[error("{0}")]
    Broker(String),
    #[error("exchange {exchange:?} routed the message to no queue (routing key {routing_key:?})")]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    #[error("publish to exchange {exchange:?}: {reason}")]
    Publish { exchange: String, reason: String },
}

/// Delivers pending rows until `shutdown`; several hosts may run it on the same database.
pub fn spawn_relay(
    config: OutboxConfig,
    http: BTreeMap<String, reqwest::Client>,
    database: Database,
    metrics: Arc<Metrics>,
    waker: RelayWaker,
    shutdown: CancellationToken,
) {
    tokio::spawn(async move {
        let mut relay = Relay {
            config,
            pool: database.pool,
            tables: database.tables,
            metrics,
            http,
            amqp: amqp::Publisher::default(),
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
                match outbox::clean(&relay.pool, &relay.tables, relay.config.retention).await {
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
        relay.amqp.close().await;
        debug!("Outbox relay stopped.");
    });
}

struct Relay {
    config: OutboxConfig,
    pool: PgPool,
    tables: Arc<Tables>,
    metrics: Arc<Metrics>,
    /// By destination name.
    http: BTreeMap<String, reqwest::Client>,
    amqp: amqp::Publisher,
}

impl Relay {
    /// Takes one batch, delivers it, records the results, commits. Returns the rows taken.
    async fn pass(&mut self) -> Result<usize, sqlx::Error> {
        let (mut transaction, rows) =
            outbox::take(&self.pool, &self.tables, self.config.batch_size).await?;
        for row in &rows {
            let attempt = match self.deliver(row).await {
                Ok(()) => {
                    debug!(id = row.id, destination = %row.destination, "Outbox row delivered.");
                    self.metrics.outbox_delivered(&row.destination, "delivered");
                    Attempt::Delivered
                }
                Err(error) => {
                    let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
                    let park = attempts >= self.config.max_attempts.get();
                    if park {
                        warn!(id = row.id, destination = %row.destination, key = %row.idempotency_key, attempts, %error, "Outbox row parked after its last attempt.");
                    } else {
                        debug!(id = row.id, destination = %row.destination, attempts, %error, "Outbox delivery failed; will retry.");
                    }
                    self.metrics
                        .outbox_delivered(&row.destination, if park { "parked" } else { "failed" });
                    Attempt::Failed {
                        error: error.to_string(),
                        retry_in: RETRIES.delay(attempts),
                        park,
                    }
                }
            };
            outbox::record(&mut transaction, &self.tables, row.id, &attempt).await?;
        }
        transaction.commit().await?;
        Ok(rows.len())
    }

    /// Hands one row to its destination, in a span of its own (a child of the message span
    /// that wrote the row) whose context goes with it; `Ok` only once the destination
    /// confirmed it.
    async fn deliver(&mut self, row: &Taken) -> Result<(), DeliveryError> {
        let (span, trace) = traces::delivery_span(
            &row.destination,
            &row.idempotency_key,
            row.id,
            row.attempts + 1,
            row.trace.as_ref(),
        );
        let headers = outgoing_headers(row, trace);
        let delivered = self
            .deliver_to(row, &headers)
            .instrument(span.clone())
            .await;
        if let Err(error) = &delivered {
            traces::failed(&span, &error.to_string());
        }
        delivered
    }

    async fn deliver_to(
        &mut self,
        row: &Taken,
        headers: &[(String, String)],
    ) -> Result<(), DeliveryError> {
        let destination = self
            .config
            .destinations
            .get(&row.destination)
            .ok_or_else(|| DeliveryError::UnknownDestination(row.destination.clone()))?;
        match destination {
            Destination::Http { url, timeout, .. } => {
                let client = self
                    .http
                    .get(&row.destination)
                    .ok_or_else(|| DeliveryError::NoClient(row.destination.clone()))?;
                http::deliver(client, url, *timeout, row, headers).await
            }
            Destination::Amqp {
                broker,
                exchange,
                routing_key,
            } => {
                self.amqp
                    .deliver(broker, exchange, routing_key, row, headers)
                    .await
            }
        }
    }
}

/// The headers a delivery sends: the row's, with the trace context's (`traceparent`,
/// `tracestate`) in place of any the plugin set.
fn outgoing_headers(row: &Taken, trace: Option<TraceContext>) -> Vec<(String, String)> {
    let Some(trace) = trace else {
        return row.headers.clone();
    };
    let mut headers: Vec<(String, String)> = row
        .headers
        .iter()
        .filter(|(name, _)| {
            !name.eq_ignore_ascii_case(traces::TRACEPARENT)
                && !name.eq_ignore_ascii_case(traces::TRACESTATE)
        })
        .cloned()
        .collect();
    headers.extend(
        trace
            .headers()
            .into_iter()
            .map(|(name, value)| (name.to_string(), value.to_string())),
    );
    headers
}
