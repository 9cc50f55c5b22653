//! The tries of one message's (or batch's) transaction: transient errors retried without
//! limit, conflicts up to the pipeline's budget, timeouts counted, and a configuration fault
//! pausing the pipeline, with one probing transaction kept while the others give their
//! messages back.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;
use crate::config::OnTimeout;
use crate::pipeline::{Paused, Pipeline};
use crate::store::fault;
use crate::store::ledger::LedgerError;

use super::disposition::Disposition;

/// How long a paused pipeline waits between tries of the transaction that paused it.
pub(super) const PAUSE_RETRY: Duration = Duration::from_secs(3);

/// An outdated cached plan (0A000) is cured by a new connection; one that comes back this
/// many times in a row is a real `feature not supported`, a configuration fault.
pub(super) const STALE_PLAN_TRIES: u32 = 3;

/// The statement a pause names when every statement fails alike (a plan the server keeps
/// refusing), so that any committed transaction ends it.
pub(super) const ANY_STATEMENT: &str = "(any)";

/// Paces the retries of one message's (or batch's) transaction: transient errors are
/// retried without limit (the message stays unacked), conflicts (40001, 40P01) up to the
/// pipeline's budget, and a configuration fault pauses the pipeline until a try succeeds.
pub(super) struct Retries<'a> {
    pipeline: &'a Pipeline,
    shutdown: &'a CancellationToken,
    backoff: Backoff,
    conflicts: u32,
    stale_plans: u32,
    /// This transaction is the pipeline's probe while a configuration fault pauses it
    /// (`Pipeline::take_probe`).
    paused: bool,
    /// How many messages the transaction holds: only one alone may be the probe.
    messages: usize,
    /// Tries that ran out of time (`ran_out_of_time`).
    timeouts: u32,
}

impl Drop for Retries<'_> {
    /// A probe that gave up (the host stopping, a conflict past its budget) leaves the role
    /// to the next transaction that meets the fault.
    fn drop(&mut self) {
        if self.paused {
            self.pipeline.release_probe();
        }
    }
}

impl<'a> Retries<'a> {
    pub(super) fn new(
        pipeline: &'a Pipeline,
        shutdown: &'a CancellationToken,
        messages: usize,
    ) -> Retries<'a> {
        Retries {
            pipeline,
            shutdown,
            backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(5)),
            conflicts: 0,
            stale_plans: 0,
            paused: false,
            messages,
            timeouts: 0,
        }
    }

    /// The transaction finished (whatever its outcome): a pause it caused ends, and so does
    /// one it proves over, having committed the statement the pipeline paused on (`ran`
    /// says which it ran; any statement proves a pause on [`ANY_STATEMENT`]). The transaction
    /// that met the fault may have given up (the host stopping, its conflicts or timeouts
    /// spent): the message the consumer then takes alone to find out must end the pause.
    pub(super) fn succeeded(&mut self, ran: impl Fn(&str) -> bool) {
        let pipeline = self.pipeline;
        if self.paused {
            pipeline.resume();
            pipeline.release_probe();
            self.paused = false;
        } else if let Some(paused) = pipeline.paused()
            && (paused.statement == ANY_STATEMENT || ran(&paused.statement))
        {
            pipeline.resume();
        }
    }

    /// Records a retried failure and waits before the next try. `Some(Requeue)` when it
    /// gives up: the conflict budget is spent, or the host is stopping; and after
    /// `transaction.timeouts` timed-out tries, what `transaction.on_timeout` says.
    pub(super) async fn failed(
        &mut self,
        key: &str,
        error: &LedgerError,
        took: Duration,
    ) -> Option<Disposition> {
        let pipeline = self.pipeline;
        if let Some(give_up) = self.timed_out(key, error, took) {
            return Some(give_up);
        }
        let (label, delay) = match error {
            LedgerError::Transient { source } => {
                let label = fault::retry_label(source);
                if fault::is_stale_plan(source) {
                    self.stale_plans += 1;
                    if self.stale_plans >= STALE_PLAN_TRIES {
                        return self
                            .pause(ANY_STATEMENT, &label, &fault::describe(source))
                            .await;
                    }
                } else {
                    self.stale_plans = 0;
                }
                let conflict = fault::is_conflict(source);
                if conflict {
                    self.conflicts += 1;
                    let budget = pipeline.config.transaction.retries;
                    if self.conflicts > budget {
                        pipeline.metrics.database_retried(pipeline.name(), &label);
                        warn!(
                            %key,
                            error = %source,
                            retries = budget,
                            "Transaction kept conflicting; the message goes back to the queue."
                        );
                        return Some(Disposition::Requeue);
                    }
                }
                let delay = self.backoff.next_delay();
                if conflict {
                    debug!(%key, error = %source, retry_in_ms = delay.as_millis() as u64, "Transaction conflicted; retrying it.");
                } else {
                    warn!(
                        pipeline = %pipeline.name(),
                        %key,
                        error = %fault::describe(source),
                        retry_in_ms = delay.as_millis() as u64,
                        "PostgreSQL unavailable; the message stays unacked and will be retried."
                    );
                }
                (label, delay)
            }
            LedgerError::Deadline { .. } => {
                let delay = self.backoff.next_delay();
                warn!(
                    pipeline = %pipeline.name(),
                    %key,
                    %error,
                    retry_in_ms = delay.as_millis() as u64,
                    "Transaction deadline passed; retrying on a new connection."
                );
                ("deadline".to_string(), delay)
            }
            LedgerError::Config { statement, source } => {
                let label = fault::retry_label(source);
                return self
                    .pause(statement, &label, &fault::describe(source))
                    .await;
            }
            LedgerError::Effect { .. } => return Some(Disposition::Requeue),
        };
        pipeline.metrics.database_retried(pipeline.name(), &label);
        self.wait(delay).await
    }

    /// Counts a try that timed out; after `transaction.timeouts` of them, what
    /// `transaction.on_timeout` says.
    pub(super) fn timed_out(
        &mut self,
        key: &str,
        error: &LedgerError,
        took: Duration,
    ) -> Option<Disposition> {
        if !ran_out_of_time(self.pipeline, error, took) {
            return None;
        }
        self.timeouts += 1;
        let pipeline = self.pipeline;
        let settings = &pipeline.config.transaction;
        if self.timeouts < settings.timeouts.get() {
            return None;
        }
        pipeline
            .metrics
            .database_retried(pipeline.name(), "timeout");
        warn!(
            pipeline = %pipeline.name(),
            %key,
            %error,
            timeouts = self.timeouts,
            "The transaction kept timing out; it stops holding its worker (transaction.on_timeout)."
        );
        Some(match settings.on_timeout {
            OnTimeout::Requeue => Disposition::Requeue,
            OnTimeout::DeadLetter => Disposition::DeadLetter {
                error_kind: "transaction-timeout",
                reason: format!(
                    "its transaction timed out {} times (transaction.timeouts): {error}",
                    self.timeouts
                ),
            },
        })
    }

    /// Pauses the pipeline for a configuration fault and waits to try again, as the one
    /// transaction that keeps trying (the probe whose success resumes the pipeline: a single
    /// message, the first to meet the fault). Any other transaction meeting it, and a batch
    /// of several messages, gives its messages back to the queue (`Requeue`), for a healthy
    /// host to take, instead of holding them here; the consumer then takes one message
    /// alone to probe with (`consumer::serve`).
    pub(super) async fn pause(
        &mut self,
        statement: &str,
        sqlstate: &str,
        reason: &str,
    ) -> Option<Disposition> {
        let pipeline = self.pipeline;
        pipeline.metrics.database_retried(pipeline.name(), sqlstate);
        pipeline.pause(Paused {
            statement: statement.to_string(),
            sqlstate: sqlstate.to_string(),
            reason: reason.to_string(),
        });
        if !self.paused {
            if self.messages > 1 || !pipeline.take_probe() {
                info!(
                    pipeline = %pipeline.name(),
                    statement,
                    "Pipeline paused; the message goes back to the queue for a healthy host."
                );
                return Some(Disposition::Requeue);
            }
            self.paused = true;
        }
        self.wait(PAUSE_RETRY).await
    }

    pub(super) async fn wait(&self, delay: Duration) -> Option<Disposition> {
        tokio::select! {
            () = tokio::time::sleep(delay) => None,
            () = self.shutdown.cancelled() => Some(Disposition::Requeue),
        }
    }
}

/// Whether a try that failed with `error` after `took` ran out of time: the host's deadline
/// passed, or a statement was cancelled (57014) after at least `transaction.statement_timeout`.
/// A cancel that comes sooner is an operator's (`pg_cancel_backend`), not the message's
/// slowness, and is retried like any other outage.
pub(super) fn ran_out_of_time(pipeline: &Pipeline, error: &LedgerError, took: Duration) -> bool {
    let limit = pipeline.config.transaction.statement_timeout;
    match error {
        LedgerError::Deadline { .. } => true,
        LedgerError::Transient { source } => {
            fault::is_cancelled(source) && !limit.is_zero() && took >= limit
        }
        LedgerError::Effect { .. } | LedgerError::Config { .. } => false,
    }
}
