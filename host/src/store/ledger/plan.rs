//! What one message's transaction will do, decided before it runs: the claim strategy its
//! pipeline's `claim` mode and the decision give, and the statements bound to the effects.

use tokio_postgres::types::Type;

use crate::config::{ClaimMode, PipelineConfig};
use crate::effect::{Decision, Effect};
use crate::store::ledger::ClaimOutcome;
use crate::store::outbox::{OutboxError, OutboxRow};
use crate::store::statement::{BoundEffect, EffectError, StatementCatalog};

/// Partition mode's claim (see `partition`): under a transaction-scoped advisory lock on the
/// key, insert only if no partition holds the key yet (`Tables::partitioned_claim`). Two
/// statements, because the check must see what a lock holder committed: a statement's
/// snapshot predates its own lock wait.
pub(super) const PARTITIONED_LOCK_SQL: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2, 0))";

pub(super) const PARTITIONED_LOCK_TYPES: [Type; 2] = [Type::TEXT, Type::TEXT];

/// How the transaction recognises a message it already applied.
#[derive(Debug, Clone, Copy)]
pub enum ClaimStrategy<'a> {
    /// A `processed_messages` row for `(consumer, key)`, recording the plugin build.
    Ledger {
        consumer: &'a str,
        plugin_digest: &'a str,
        /// `processed_messages` is partitioned by day (see `partition`).
        partitioned: bool,
    },
    /// The plan's first effect is the claim: zero rows affected means duplicate.
    Natural,
    /// No claim: zero rows affected by every effect means stale.
    None,
}

impl ClaimStrategy<'_> {
    /// A claim the batch fast path takes in one statement for every message.
    pub(super) fn is_bulk(&self) -> bool {
        matches!(
            self,
            ClaimStrategy::Ledger {
                partitioned: false,
                ..
            }
        )
    }
}

/// Everything one message's transaction does, checked before it opens.
#[derive(Debug)]
pub struct Plan<'a> {
    /// The decision's idempotency key.
    pub key: &'a str,
    pub claim: ClaimStrategy<'a>,
    /// The role the effects run as (`SET LOCAL ROLE`).
    pub role: Option<&'a str>,
    /// Statement calls in order; with a natural claim, the claim statement first.
    pub effects: Vec<BoundEffect<'a>>,
    pub outbox: Vec<OutboxRow>,
    /// The consumer name the outbox rows record.
    pub consumer: &'a str,
    /// The W3C trace context the outbox rows carry to their deliveries (`crate::telemetry::traces`).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// The message was delivered before (the broker says so, or this is another attempt):
    /// likely a duplicate, so the claim asks before the effects leave (see `one_flight`).
    pub redelivered: bool,
}

/// A decision that cannot become a transaction: the message is rejected, nothing runs.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Effect(#[from] EffectError),
    #[error(transparent)]
    Outbox(#[from] OutboxError),
    #[error(
        "claim = \"natural\" needs exactly one call of its claim statement {statement:?}; the decision has {calls}"
    )]
    ClaimStatement { statement: String, calls: usize },
}

impl<'a> Plan<'a> {
    /// Checks every effect of `decision` against the pipeline's statements and outbox
    /// destinations, and orders them for `config`'s claim strategy.
    pub fn build(
        config: &'a PipelineConfig,
        statements: &'a StatementCatalog,
        decision: &'a Decision,
        plugin_digest: &'a str,
        partitioned: bool,
    ) -> Result<Plan<'a>, PlanError> {
        let mut effects = Vec::with_capacity(decision.effects.len());
        let mut outbox = Vec::new();
        for effect in &decision.effects {
            match effect {
                Effect::Exec { statement, params } => {
                    effects.push(statements.bind(statement, params)?);
                }
                Effect::Outbox(message) => outbox.push(OutboxRow::from_effect(
                    message,
                    &decision.key,
                    config.outbox.as_ref(),
                )?),
            }
        }
        let claim = match config.claim {
            ClaimMode::Ledger => ClaimStrategy::Ledger {
                consumer: &config.consumer,
                plugin_digest,
                partitioned,
            },
            ClaimMode::Natural => {
                let statement = config.claim_statement.as_deref().unwrap_or_default();
                let calls: Vec<usize> = effects
                    .iter()
                    .enumerate()
                    .filter(|(_, effect)| effect.statement == statement)
                    .map(|(position, _)| position)
                    .collect();
                let [position] = calls[..] else {
                    return Err(PlanError::ClaimStatement {
                        statement: statement.to_string(),
                        calls: calls.len(),
                    });
                };
                let claim_effect = effects.remove(position);
                effects.insert(0, claim_effect);
                ClaimStrategy::Natural
            }
            ClaimMode::None => ClaimStrategy::None,
        };
        Ok(Plan {
            key: &decision.key,
            claim,
            role: config.transaction.role.as_deref(),
            effects,
            outbox,
            consumer: &config.consumer,
            traceparent: None,
            tracestate: None,
            redelivered: false,
        })
    }
}

impl Plan<'_> {
    /// Makes the outbox rows carry `trace` to their deliveries.
    pub fn carry(&mut self, trace: Option<crate::telemetry::traces::TraceContext>) {
        (self.traceparent, self.tracestate) = match trace {
            Some(trace) => (Some(trace.traceparent), trace.tracestate),
            None => (None, None),
        };
    }

    /// Whether this plan's transaction, having ended with `outcome` and committed, ran
    /// `statement` to its end: an effect's name, or the host's own `claim` or `outbox`. That
    /// the statement a configuration fault paused the pipeline on works again is proven by
    /// any transaction that ran it, not only by the one that met the fault.
    pub fn ran(&self, statement: &str, outcome: ClaimOutcome) -> bool {
        let host_claim = matches!(self.claim, ClaimStrategy::Ledger { .. });
        let named = |effect: &BoundEffect| effect.statement == statement;
        match (outcome, statement) {
            (_, "claim") => host_claim,
            (ClaimOutcome::Applied, "outbox") => !self.outbox.is_empty(),
            (ClaimOutcome::Applied | ClaimOutcome::Stale, _) => self.effects.iter().any(named),
            // A duplicate ran its claim only: the host's, or a natural claim's statement.
            (ClaimOutcome::Duplicate, _) => !host_claim && self.effects.first().is_some_and(named),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;
    use crate::effect::Value;

    fn config(claim: &str) -> Config {
        let text = format!(
            r#"
[database]
url = "postgres://127.0.0.1/ran"

[amqp]
url = "amqp://127.0.0.1"

[pipelines.ran]
queue = "ran"
plugin = "ran.wasm"
{claim}

[pipelines.ran.statements]
first = "INSERT INTO a (k) VALUES ($1)"
second = "INSERT INTO b (k) VALUES ($1)"
"#
        );
        Config::from_toml(Path::new("/tmp/ran.toml"), &text).expect("config")
    }

    fn decision() -> Decision {
        let call = |statement: &str| Effect::Exec {
            statement: statement.to_string(),
            params: vec![Value::Text("k".to_string())],
        };
        Decision {
            key: "k".to_string(),
            effects: vec![call("second"), call("first")],
        }
    }

    /// What a committed transaction proves: every statement it ran, and for a duplicate only
    /// its claim, so that a duplicate does not end a pause on an effect it never ran.
    #[test]
    fn a_committed_plan_ran_its_claim_and_what_its_outcome_says() {
        let decision = decision();
        let ledger = config("");
        let catalog = StatementCatalog::from_config(&ledger.pipelines[0]);
        let plan =
            Plan::build(&ledger.pipelines[0], &catalog, &decision, "d", false).expect("plan");
        assert!(plan.ran("first", ClaimOutcome::Applied));
        assert!(plan.ran("claim", ClaimOutcome::Applied));
        assert!(!plan.ran("outbox", ClaimOutcome::Applied), "no outbox row");
        assert!(plan.ran("claim", ClaimOutcome::Duplicate));
        assert!(!plan.ran("first", ClaimOutcome::Duplicate));
        assert!(!plan.ran("third", ClaimOutcome::Applied));

        let natural = config("claim = \"natural\"\nclaim_statement = \"first\"");
        let catalog = StatementCatalog::from_config(&natural.pipelines[0]);
        let plan =
            Plan::build(&natural.pipelines[0], &catalog, &decision, "d", false).expect("plan");
        assert!(!plan.ran("claim", ClaimOutcome::Applied), "no host claim");
        assert!(
            plan.ran("first", ClaimOutcome::Duplicate),
            "the natural claim ran"
        );
        assert!(!plan.ran("second", ClaimOutcome::Duplicate));
        assert!(plan.ran("second", ClaimOutcome::Applied));
    }
}
