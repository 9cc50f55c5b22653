//! One message, start to finish: plugin → claim and effects in one transaction → disposition.
//!
//! Architecture invariant: this is the only place that picks a [`Disposition`], and an
//! applied message is acked only after its transaction committed.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, warn};

use crate::backoff::Backoff;
use crate::effect::{FailureKind, Outcome};
use crate::failpoint::Failpoint;
use crate::ledger::{self, ClaimOutcome, LedgerError, Plan};
use crate::message::InboundMessage;
use crate::pipeline::Pipeline;
use crate::plugin::PluginError;

/// Longest idempotency key accepted; longer keys would not fit the claim's btree index.
pub const MAX_KEY_BYTES: usize = 1024;

/// How a message ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Settled: ack it.
    Ack(Settled),
    /// Permanently failed: dead-letter it with the reason, then ack it.
    DeadLetter {
        error_kind: &'static str,
        reason: String,
    },
    /// The plugin asked for another try: republish with `attempt`, then ack.
    Retry { attempt: u32, reason: String },
    /// Not settled (the host is stopping while the database is down, or the transaction
    /// kept conflicting past the retry budget): return it to the queue.
    Requeue,
}

/// The outcomes of a settled message, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Applied,
    Duplicate,
    /// `claim = "none"`: no effect changed a row (an older or repeated version).
    Stale,
    Skipped,
}

impl Disposition {
    /// The outcome word counted in metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            Disposition::Ack(settled) => settled.as_str(),
            Disposition::DeadLetter { .. } => "rejected",
            Disposition::Retry { .. } => "retried",
            Disposition::Requeue => "requeued",
        }
    }
}

impl Settled {
    pub fn as_str(self) -> &'static str {
        match self {
            Settled::Applied => "applied",
            Settled::Duplicate => "duplicate",
            Settled::Stale => "stale",
            Settled::Skipped => "skipped",
        }
    }
}

/// Runs `message` through the pipeline's plugin and ledger and says how it ends.
pub async fn handle_delivery(
    pipeline: &Pipeline,
    message: &InboundMessage,
    attempt: u32,
    shutdown: &CancellationToken,
) -> Disposition {
    let span = tracing::debug_span!(
        "handle_delivery",
        pipeline = %pipeline.config.name,
        message_id = message.message_id.as_deref().unwrap_or(""),
        attempt,
        otel.kind = "consumer",
        messaging.system = "rabbitmq",
    );
    decide(pipeline, message, attempt, shutdown)
        .instrument(span)
        .await
}

async fn decide(
    pipeline: &Pipeline,
    message: &InboundMessage,
    attempt: u32,
    shutdown: &CancellationToken,
) -> Disposition {
    // One build decides and is recorded in the claim, even if a swap happens meanwhile.
    let plugin = pipeline.plugin.load_full();
    let plugin_started = Instant::now();
    let invoked = pipeline
        .runtime
        .invoke(&plugin, &pipeline.config.limits, message)
        .await;
    pipeline
        .metrics
        .plugin_called(pipeline.name(), plugin_started.elapsed());
    let outcome = match invoked {
        Ok(outcome) => outcome,
        Err(PluginError::Rejected(failure)) if failure.kind == FailureKind::Retryable => {
            let max_attempts = pipeline.config.max_attempts.get();
            return if attempt >= max_attempts {
                Disposition::DeadLetter {
                    error_kind: "retries-exhausted",
                    reason: format!(
                        "gave up after {attempt} attempts (max_attempts = {max_attempts}): {}",
                        failure.reason
                    ),
                }
            } else {
                Disposition::Retry {
                    attempt: attempt + 1,
                    reason: failure.reason,
                }
            };
        }
        Err(error) => {
            return Disposition::DeadLetter {
                error_kind: plugin_error_kind(&error),
                reason: error.to_string(),
            };
        }
    };
    let decision = match outcome {
        Outcome::Skip { reason } => {
            debug!(%reason, "Plugin skipped the message.");
            return Disposition::Ack(Settled::Skipped);
        }
        Outcome::Decision(decision) => decision,
    };
    if decision.key.len() > MAX_KEY_BYTES {
        return Disposition::DeadLetter {
            error_kind: "invalid-output",
            reason: format!(
                "idempotency key of {} bytes, limit is {MAX_KEY_BYTES}",
                decision.key.len()
            ),
        };
    }
    let plan = match Plan::build(
        &pipeline.config,
        &pipeline.statements,
        &decision,
        &plugin.digest,
        pipeline.partitioned_claims,
    ) {
        Ok(plan) => plan,
        Err(error) => {
            return Disposition::DeadLetter {
                error_kind: "invalid-effect",
                reason: error.to_string(),
            };
        }
    };
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
    let mut conflicts = 0;
    loop {
        let transaction_started = Instant::now();
        let applied = ledger::apply(&pipeline.pool, &plan).await;
        pipeline
            .metrics
            .transaction_finished(pipeline.name(), transaction_started.elapsed());
        match applied {
            Ok(ClaimOutcome::Applied) => {
                Failpoint::AfterCommit.hit();
                if !plan.outbox.is_empty() {
                    pipeline.relay.wake();
                }
                debug!(key = %decision.key, "Applied.");
                return Disposition::Ack(Settled::Applied);
            }
            Ok(ClaimOutcome::Duplicate) => {
                debug!(key = %decision.key, "Duplicate: already applied.");
                return Disposition::Ack(Settled::Duplicate);
            }
            Ok(ClaimOutcome::Stale) => {
                debug!(key = %decision.key, "Stale: no effect changed a row.");
                return Disposition::Ack(Settled::Stale);
            }
            Err(LedgerError::Effect { statement, source }) => {
                return Disposition::DeadLetter {
                    error_kind: "sql",
                    reason: format!(
                        "statement {statement:?} failed, claim rolled back: {}",
                        sql_error_text(&source)
                    ),
                };
            }
            Err(LedgerError::Transient { source }) => {
                pipeline
                    .metrics
                    .database_retried(pipeline.name(), &ledger::retry_label(&source));
                if ledger::is_conflict(&source) {
                    conflicts += 1;
                    let budget = pipeline.config.transaction.retries;
                    if conflicts > budget {
                        warn!(
                            key = %decision.key,
                            error = %source,
                            retries = budget,
                            "Transaction kept conflicting; the message goes back to the queue."
                        );
                        return Disposition::Requeue;
                    }
                }
                let delay = backoff.next_delay();
                if ledger::is_conflict(&source) {
                    debug!(key = %decision.key, error = %source, retry_in_ms = delay.as_millis() as u64, "Transaction conflicted; retrying it.");
                } else {
                    warn!(
                        key = %decision.key,
                        error = %source,
                        retry_in_ms = delay.as_millis() as u64,
                        "PostgreSQL unavailable; the message stays unacked and will be retried."
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = shutdown.cancelled() => return Disposition::Requeue,
                }
            }
        }
    }
}

fn plugin_error_kind(error: &PluginError) -> &'static str {
    match error {
        PluginError::Rejected(_) => "invalid-input",
        PluginError::DeadlineExceeded { .. } => "plugin-deadline",
        PluginError::MemoryExceeded { .. } => "plugin-memory",
        PluginError::Trap { .. } => "plugin-trap",
        PluginError::OutputTooLarge { .. } | PluginError::InvalidOutput { .. } => "invalid-output",
        PluginError::Read { .. } | PluginError::Invalid { .. } => "plugin-load",
    }
}

/// The database's own words, with its SQLSTATE when it gave one.
fn sql_error_text(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(database_error) => match database_error.code() {
            Some(code) => format!("{} (SQLSTATE {code})", database_error.message()),
            None => database_error.message().to_string(),
        },
        other => other.to_string(),
    }
}
