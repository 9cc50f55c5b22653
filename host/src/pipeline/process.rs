//! One message, start to finish: plugin → claim and effects in one transaction → disposition.
//!
//! Architecture invariant: this is the only place that picks a [`Disposition`], and an
//! applied message is acked only after its transaction committed.

use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, warn};

use crate::effect::{Decision, FailureKind, MAX_KEY_BYTES, Outcome};
use crate::failpoint::Failpoint;
use crate::message::InboundMessage;
use crate::pipeline::Pipeline;
use crate::sandbox::{LoadedPlugin, PluginError};
use crate::store::fault;
use crate::store::ledger::{self, BatchItem, ClaimOutcome, LedgerError, Plan};
use crate::telemetry::traces::MessageSpan;

pub use super::disposition::{Disposition, Settled};
use super::retries::{Retries, ran_out_of_time};

/// Runs `message` through the pipeline's plugin and ledger and says how it ends.
pub async fn handle_delivery(
    pipeline: &Pipeline,
    message: &InboundMessage,
    attempt: u32,
    shutdown: &CancellationToken,
) -> Disposition {
    let group = pipeline.config.source.consumer_group();
    let traced = MessageSpan::start(pipeline.name(), group, message, attempt);
    let disposition = async {
        let (decision, plugin) = match decide(pipeline, message, attempt).await {
            Decided::Done(disposition) => return disposition,
            Decided::Apply { decision, plugin } => (decision, plugin),
        };
        traced.decided(&decision.key, &plugin.digest);
        let plan = match plan(pipeline, &decision, &plugin, &traced, (message, attempt)) {
            Ok(plan) => plan,
            Err(disposition) => return disposition,
        };
        apply_one(pipeline, &plan, shutdown, &traced, 1).await
    }
    .instrument(traced.span().clone())
    .await;
    traced.ended(disposition.outcome(), disposition.error());
    disposition
}

/// Applies one message's plan in its own transaction, retrying transient failures. `held`:
/// how many messages the worker holds with it (a batch applied one at a time), which wait
/// while it retries.
async fn apply_one(
    pipeline: &Pipeline,
    plan: &Plan<'_>,
    shutdown: &CancellationToken,
    traced: &MessageSpan,
    held: usize,
) -> Disposition {
    let mut retries = Retries::new(pipeline, shutdown, held);
    let mut tries = 0;
    loop {
        tries += 1;
        let started = Instant::now();
        let result = ledger::apply(&pipeline.sessions, &pipeline.config.transaction, plan).await;
        let took = started.elapsed();
        pipeline.metrics.transaction_finished(pipeline.name(), took);
        traced.transaction(took, tries);
        match result {
            Err(error) if error.is_retried() => {
                if let Some(give_up) = retries.failed(plan.key, &error, took).await {
                    return give_up;
                }
            }
            finished => {
                retries.succeeded(|statement| {
                    finished
                        .as_ref()
                        .is_ok_and(|outcome| plan.ran(statement, *outcome))
                });
                let disposition = disposition_of(finished);
                after_commit(pipeline, &disposition, plan, traced);
                return disposition;
            }
        }
    }
}

/// Runs several messages through the plugin, then applies all their decisions in one
/// transaction (`ledger::apply_batch`, a savepoint each). Returns one disposition per message,
/// in order.
pub async fn handle_batch(
    pipeline: &Pipeline,
    messages: &[(&InboundMessage, u32)],
    shutdown: &CancellationToken,
) -> Vec<Disposition> {
    let span = tracing::debug_span!(
        "handle_batch",
        pipeline = %pipeline.config.name,
        messages = messages.len(),
    );
    let group = pipeline.config.source.consumer_group();
    let traced: Vec<MessageSpan> = messages
        .iter()
        .map(|(message, attempt)| MessageSpan::start(pipeline.name(), group, message, *attempt))
        .collect();
    let dispositions = async {
        let mut decided = Vec::with_capacity(messages.len());
        for ((message, attempt), traced) in messages.iter().zip(&traced) {
            let decision = decide(pipeline, message, *attempt)
                .instrument(traced.span().clone())
                .await;
            if let Decided::Apply { decision, plugin } = &decision {
                traced.decided(&decision.key, &plugin.digest);
            }
            decided.push(decision);
        }
        let mut dispositions: Vec<Option<Disposition>> = vec![None; messages.len()];
        let mut planned = Vec::with_capacity(messages.len());
        for (index, decided) in decided.iter().enumerate() {
            match decided {
                Decided::Done(disposition) => dispositions[index] = Some(disposition.clone()),
                Decided::Apply { decision, plugin } => {
                    match plan(pipeline, decision, plugin, &traced[index], messages[index]) {
                        Ok(plan) => planned.push((index, plan)),
                        Err(disposition) => dispositions[index] = Some(disposition),
                    }
                }
            }
        }
        if !planned.is_empty() {
            let plans: Vec<&Plan<'_>> = planned.iter().map(|(_, plan)| plan).collect();
            let spans: Vec<&MessageSpan> =
                planned.iter().map(|(index, _)| &traced[*index]).collect();
            match apply_together(pipeline, &plans, shutdown, &spans).await {
                Ok(Some(items)) => {
                    for ((index, plan), item) in planned.iter().zip(items) {
                        let disposition = disposition_of(item);
                        after_commit(pipeline, &disposition, plan, &traced[*index]);
                        dispositions[*index] = Some(disposition);
                    }
                }
                Ok(None) => {
                    for (index, plan) in &planned {
                        let traced = &traced[*index];
                        let disposition =
                            apply_one(pipeline, plan, shutdown, traced, planned.len())
                                .instrument(traced.span().clone())
                                .await;
                        dispositions[*index] = Some(disposition);
                    }
                }
                Err(requeue) => {
                    for (index, _) in &planned {
                        dispositions[*index] = Some(requeue.clone());
                    }
                }
            }
        }
        dispositions
            .into_iter()
            .map(|disposition| disposition.unwrap_or(Disposition::Requeue))
            .collect::<Vec<_>>()
    }
    .instrument(span)
    .await;
    for (disposition, traced) in dispositions.iter().zip(&traced) {
        traced.ended(disposition.outcome(), disposition.error());
    }
    dispositions
}

/// Applies `plans` in one transaction, retrying what the database's state caused. `Ok(None)`
/// when `COMMIT` itself refused the batch (a deferred constraint): nothing was applied, and
/// only one message at a time can tell whose fault it is. `Err` is the disposition of every
/// message when the retries gave up.
async fn apply_together(
    pipeline: &Pipeline,
    plans: &[&Plan<'_>],
    shutdown: &CancellationToken,
    traced: &[&MessageSpan],
) -> Result<Option<Vec<BatchItem>>, Disposition> {
    let _one_batch_at_a_time = if plans.len() > 1 {
        Some(pipeline.batch_applier.lock().await)
    } else {
        None
    };
    let mut retries = Retries::new(pipeline, shutdown, plans.len());
    let mut tries = 0;
    loop {
        tries += 1;
        let started = Instant::now();
        let result =
            ledger::apply_batch(&pipeline.sessions, &pipeline.config.transaction, plans).await;
        let took = started.elapsed();
        pipeline.metrics.transaction_finished(pipeline.name(), took);
        for traced in traced {
            traced.transaction(took, tries);
        }
        match result {
            Ok(items) => {
                retries.succeeded(|statement| {
                    plans.iter().zip(&items).any(|(plan, item)| {
                        item.as_ref()
                            .is_ok_and(|outcome| plan.ran(statement, *outcome))
                    })
                });
                return Ok(Some(items));
            }
            // One slow message must not hold the others: timed out, the batch goes one
            // message at a time, where each is timed on its own.
            Err(error) if plans.len() > 1 && ran_out_of_time(pipeline, &error, took) => {
                warn!(pipeline = %pipeline.name(), %error, messages = plans.len(), "A batch timed out; applying its messages one at a time.");
                return Ok(None);
            }
            Err(error) if error.is_retried() => {
                if let Some(give_up) = retries.failed(plans[0].key, &error, took).await {
                    return Err(give_up);
                }
            }
            Err(_) => {
                retries.succeeded(|_| false);
                return Ok(None);
            }
        }
    }
}

/// A message after its plugin ran.
enum Decided {
    /// Its fate is known without the database (skip, rejection, retry).
    Done(Disposition),
    /// A decision to apply, with the build that made it (recorded in the claim).
    Apply {
        decision: Decision,
        plugin: Arc<LoadedPlugin>,
    },
}

/// Calls the plugin and checks what it returned.
async fn decide(pipeline: &Pipeline, message: &InboundMessage, attempt: u32) -> Decided {
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
            return Decided::Done(retry_or_give_up(attempt, max_attempts, failure.reason));
        }
        Err(error) => {
            return Decided::Done(Disposition::DeadLetter {
                error_kind: plugin_error_kind(&error),
                reason: error.to_string(),
            });
        }
    };
    let decision = match outcome {
        Outcome::Skip { reason } => {
            debug!(%reason, "Plugin skipped the message.");
            return Decided::Done(Disposition::Ack(Settled::Skipped));
        }
        Outcome::Decision(decision) => decision,
    };
    if decision.key.len() > MAX_KEY_BYTES {
        return Decided::Done(Disposition::DeadLetter {
            error_kind: "invalid-output",
            reason: format!(
                "idempotency key of {} bytes, limit is {MAX_KEY_BYTES}",
                decision.key.len()
            ),
        });
    }
    Decided::Apply { decision, plugin }
}

/// Checks a decision's effects against the pipeline; a misfit rejects the message.
/// The outbox rows carry the message span's trace context. A message the broker delivered
/// before, or on another attempt, is `Plan::redelivered`.
fn plan<'a>(
    pipeline: &'a Pipeline,
    decision: &'a Decision,
    plugin: &'a LoadedPlugin,
    traced: &MessageSpan,
    (message, attempt): (&InboundMessage, u32),
) -> Result<Plan<'a>, Disposition> {
    let mut plan = Plan::build(
        &pipeline.config,
        &pipeline.statements,
        decision,
        &plugin.digest,
        pipeline.partitioned_claims,
    )
    .map_err(|error| Disposition::DeadLetter {
        error_kind: "invalid-effect",
        reason: error.to_string(),
    })?;
    if !plan.outbox.is_empty() {
        plan.carry(traced.handed_on());
    }
    plan.redelivered = message.redelivered || attempt > 1;
    Ok(plan)
}

/// What a finished transaction means for the message.
fn disposition_of(result: Result<ClaimOutcome, LedgerError>) -> Disposition {
    match result {
        Ok(ClaimOutcome::Applied) => Disposition::Ack(Settled::Applied),
        Ok(ClaimOutcome::Duplicate) => Disposition::Ack(Settled::Duplicate),
        Ok(ClaimOutcome::Stale) => Disposition::Ack(Settled::Stale),
        Err(LedgerError::Effect { statement, source }) => Disposition::DeadLetter {
            error_kind: "sql",
            reason: format!(
                "statement {statement:?} failed, claim rolled back: {}",
                fault::describe(&source)
            ),
        },
        // `Retries` keeps every other error; one reaching here is a bug, and requeueing
        // is the safe answer.
        Err(_) => Disposition::Requeue,
    }
}

/// A retryable failure on try `attempt`: tried again, or dead-lettered once `max_attempts`
/// tries are spent.
fn retry_or_give_up(attempt: u32, max_attempts: u32, reason: String) -> Disposition {
    if attempt >= max_attempts {
        Disposition::DeadLetter {
            error_kind: "retries-exhausted",
            reason: format!(
                "gave up after {attempt} attempts (max_attempts = {max_attempts}): {reason}"
            ),
        }
    } else {
        Disposition::Retry {
            attempt: attempt + 1,
            reason,
        }
    }
}

/// After a commit: the crash point for tests, a nudge to the outbox relay, and the log line.
fn after_commit(
    pipeline: &Pipeline,
    disposition: &Disposition,
    plan: &Plan<'_>,
    traced: &MessageSpan,
) {
    // In the message's own span (a batch's too), so its log line carries its trace id.
    let _entered = traced.span().enter();
    if *disposition == Disposition::Ack(Settled::Applied) {
        Failpoint::AfterCommit.hit();
        if !plan.outbox.is_empty() {
            pipeline.relay.wake();
        }
        debug!(key = %plan.key, "Applied.");
    } else {
        debug!(key = %plan.key, outcome = disposition.outcome(), "Settled without changes.");
    }
}

fn plugin_error_kind(error: &PluginError) -> &'static str {
    match error {
        PluginError::Rejected(_) => "invalid-input",
        PluginError::DeadlineExceeded { .. } => "plugin-deadline",
        PluginError::MemoryExceeded { .. } => "plugin-memory",
        PluginError::Trap { .. } => "plugin-trap",
        PluginError::OutputTooLarge { .. } | PluginError::InvalidOutput { .. } => "invalid-output",
        PluginError::Read { .. } | PluginError::Invalid { .. } | PluginError::Contract { .. } => {
            "plugin-load"
        }
        // Never reaches a message: `invoke` waits for a free slot.
        PluginError::PoolBusy { .. } => "plugin-pool",
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::effect::Failure;
    use crate::store::binding::BindError;
    use crate::store::session::SessionError;

    /// A value out of its parameter's range: the message's own fault (22003).
    fn out_of_range() -> SessionError {
        SessionError::Bind(BindError::Value {
            statement: "record_ledger".into(),
            index: 3,
            now: "int4",
            problem: "4294967296 is out of range for integer (int4)".into(),
        })
    }

    #[track_caller]
    fn check(result: Result<ClaimOutcome, LedgerError>, expected: &Disposition) {
        assert_eq!(&disposition_of(result), expected);
    }

    /// What a finished transaction means for the message: only the message's own fault
    /// dead-letters it; every other error the retries did not resolve puts it back.
    #[test]
    fn transactions_end_in_their_dispositions() {
        check(
            Ok(ClaimOutcome::Applied),
            &Disposition::Ack(Settled::Applied),
        );
        check(
            Ok(ClaimOutcome::Duplicate),
            &Disposition::Ack(Settled::Duplicate),
        );
        check(Ok(ClaimOutcome::Stale), &Disposition::Ack(Settled::Stale));
        let Disposition::DeadLetter { error_kind, reason } =
            disposition_of(Err(LedgerError::Effect {
                statement: "record_ledger".into(),
                source: out_of_range(),
            }))
        else {
            panic!("an effect's failure dead-letters the message");
        };
        assert_eq!(error_kind, "sql");
        assert!(
            reason.contains("\"record_ledger\"") && reason.contains("out of range"),
            "{reason}"
        );
        for kept in [
            LedgerError::Transient {
                source: SessionError::Timeout {
                    timeout: Duration::from_secs(5),
                    max: 4,
                },
            },
            LedgerError::Deadline {
                timeout: Duration::from_secs(30),
            },
            LedgerError::Config {
                statement: "record_ledger".into(),
                source: out_of_range(),
            },
        ] {
            assert!(kept.is_retried(), "{kept:?}");
            check(Err(kept), &Disposition::Requeue);
        }
    }

    /// A retryable failure is tried again until `max_attempts` tries are spent.
    #[test]
    fn retryable_failures_are_retried_then_dead_lettered() {
        assert_eq!(
            retry_or_give_up(1, 3, "busy".into()),
            Disposition::Retry {
                attempt: 2,
                reason: "busy".into()
            }
        );
        assert_eq!(
            retry_or_give_up(2, 3, "busy".into()),
            Disposition::Retry {
                attempt: 3,
                reason: "busy".into()
            }
        );
        for attempt in [3, 4] {
            let Disposition::DeadLetter { error_kind, reason } =
                retry_or_give_up(attempt, 3, "busy".into())
            else {
                panic!("try {attempt} of 3 gives up");
            };
            assert_eq!(error_kind, "retries-exhausted");
            assert_eq!(
                reason,
                format!("gave up after {attempt} attempts (max_attempts = 3): busy")
            );
        }
        assert_eq!(retry_or_give_up(1, 1, "busy".into()).outcome(), "rejected");
    }

    /// Each way a plugin call fails names its kind in the dead letter.
    #[test]
    fn plugin_failures_have_their_kinds() {
        let cases = [
            (
                PluginError::Rejected(Failure {
                    kind: FailureKind::InvalidInput,
                    reason: "not JSON".into(),
                }),
                "invalid-input",
            ),
            (
                PluginError::DeadlineExceeded {
                    deadline: Duration::from_millis(200),
                },
                "plugin-deadline",
            ),
            (
                PluginError::MemoryExceeded { limit_mib: 32 },
                "plugin-memory",
            ),
            (
                PluginError::Trap {
                    reason: "unreachable".into(),
                },
                "plugin-trap",
            ),
            (
                PluginError::OutputTooLarge {
                    reason: "2 MiB".into(),
                },
                "invalid-output",
            ),
            (
                PluginError::InvalidOutput {
                    reason: "a key of 0 bytes".into(),
                },
                "invalid-output",
            ),
        ];
        for (error, kind) in cases {
            assert_eq!(plugin_error_kind(&error), kind, "{error}");
        }
    }
}
