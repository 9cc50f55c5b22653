//! The one transaction per message: claim, effects, outbox rows, commit.
//!
//! Architecture invariant: the claim, the effects and the outbox rows share one transaction,
//! and a claim is never committed without its effects. A duplicate claim runs no effect.
//! Claim strategies: `ledger` (a `processed_messages` row), `natural` (the first effect's
//! unique key decides), `none` (idempotent effects; nothing changed means stale).

use sqlx::error::ErrorKind;
use sqlx::{PgPool, Postgres, Transaction};

use crate::config::{ClaimMode, Isolation, PipelineConfig};
use crate::effect::{Decision, Effect};
use crate::failpoint::Failpoint;
use crate::outbox::{self, OutboxError, OutboxRow};
use crate::statement::{BoundEffect, EffectError, StatementCatalog};

/// The guide's Step 2 claim: zero rows affected means another delivery already applied it.
/// The claim also records which plugin build decided (`plugin_digest`).
const CLAIM_SQL: &str = "INSERT INTO processed_messages (consumer, message_key, plugin_digest) \
     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";

/// What the transaction decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The claim was new: the effects ran and committed with it.
    Applied,
    /// The claim existed: nothing ran.
    Duplicate,
    /// No claim (`claim = "none"`), and no effect changed a row: an older or repeated
    /// version. Rolled back; acked.
    Stale,
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The database is unreachable, restarting, or asked us to retry (40001, 40P01):
    /// nothing was committed, and the same message may be tried again.
    #[error("database unavailable: {source}")]
    Transient { source: sqlx::Error },
    /// An effect failed in SQL (constraint, data, permission): the claim rolled back with it.
    #[error("statement {statement:?} failed: {source}")]
    Effect {
        statement: String,
        source: sqlx::Error,
    },
}

/// Partition mode's claim (see `partition`): under a transaction-scoped advisory lock on the
/// key, insert only if no partition holds the key yet. Two statements, because the check
/// must see what a lock holder committed: a statement's snapshot predates its own lock wait.
const PARTITIONED_LOCK_SQL: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2, 0))";
const PARTITIONED_CLAIM_SQL: &str = "INSERT INTO processed_messages (consumer, message_key, plugin_digest) \
     SELECT $1, $2, $3 WHERE NOT EXISTS \
       (SELECT 1 FROM processed_messages WHERE consumer = $1 AND message_key = $2) \
     ON CONFLICT DO NOTHING";

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

/// Everything one message's transaction does, checked before it opens.
#[derive(Debug)]
pub struct Plan<'a> {
    /// The decision's idempotency key.
    pub key: &'a str,
    pub claim: ClaimStrategy<'a>,
    pub isolation: Isolation,
    /// The role the effects run as (`SET LOCAL ROLE`).
    pub role: Option<&'a str>,
    /// Statement calls in order; with a natural claim, the claim statement first.
    pub effects: Vec<BoundEffect<'a>>,
    pub outbox: Vec<OutboxRow>,
    /// The consumer name the outbox rows record.
    pub consumer: &'a str,
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
            isolation: config.transaction.isolation,
            role: config.transaction.role.as_deref(),
            effects,
            outbox,
            consumer: &config.consumer,
        })
    }
}

/// Runs `plan` in one transaction: the claim, and only if it is new, the effects and the
/// outbox rows; then commit.
pub async fn apply(pool: &PgPool, plan: &Plan<'_>) -> Result<ClaimOutcome, LedgerError> {
    let transient = |source| LedgerError::Transient { source };
    let mut transaction = begin(pool, plan.isolation).await?;
    let outcome = apply_steps(&mut transaction, plan, false).await?;
    if outcome != ClaimOutcome::Applied {
        // A duplicate or stale message commits nothing.
        transaction.rollback().await.map_err(transient)?;
        return Ok(outcome);
    }
    Failpoint::BeforeCommit.hit();
    transaction
        .commit()
        .await
        .map_err(|source| classify(source, "commit"))?;
    Ok(outcome)
}

/// How one message of a batch ended inside the batch's transaction.
pub type BatchItem = Result<ClaimOutcome, LedgerError>;

/// Runs `plans` in ONE transaction. Ledger claims are taken in key order, so two batches
/// never deadlock on claims, and a key repeated within the batch is a duplicate without a
/// round trip. If a message's effect fails, the batch is run again with a savepoint per
/// message: that message rolls back to its savepoint (its item is `Err(LedgerError::Effect)`)
/// and the others commit. A transient error fails the whole batch (`Err`), to be retried as
/// a whole.
pub async fn apply_batch(
    pool: &PgPool,
    isolation: Isolation,
    plans: &[&Plan<'_>],
) -> Result<Vec<BatchItem>, LedgerError> {
    match apply_batch_optimistic(pool, isolation, plans).await? {
        Some(items) => Ok(items),
        None => apply_batch_isolating(pool, isolation, plans).await,
    }
}

/// The claims of every ledger plan in one statement, in byte order of the key (the order
/// every host and the savepoint path take them in); returns the keys that were new.
const BULK_CLAIM_SQL: &str = "INSERT INTO processed_messages (consumer, message_key, plugin_digest) \
     SELECT $1, claim.key, claim.digest FROM unnest($2::text[], $3::text[]) AS claim(key, digest) \
     ORDER BY claim.key COLLATE \"C\" \
     ON CONFLICT DO NOTHING RETURNING message_key";

/// The fast path: all ledger claims in one round trip, then each new message's effects with
/// no savepoint. `Ok(None)` when an effect failed: everything was rolled back, and the caller
/// isolates the failure with savepoints.
async fn apply_batch_optimistic(
    pool: &PgPool,
    isolation: Isolation,
    plans: &[&Plan<'_>],
) -> Result<Option<Vec<BatchItem>>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let mut transaction = begin(pool, isolation).await?;
    let bulk = |plan: &Plan<'_>| {
        matches!(
            plan.claim,
            ClaimStrategy::Ledger {
                partitioned: false,
                ..
            }
        )
    };
    let mut claim_keys = Vec::new();
    let mut claim_digests = Vec::new();
    let mut consumer = "";
    let mut first_of_key = std::collections::HashSet::new();
    for &index in &order {
        let plan = plans[index];
        if let ClaimStrategy::Ledger {
            consumer: plan_consumer,
            plugin_digest,
            partitioned: false,
        } = plan.claim
        {
            if first_of_key.insert(plan.key) {
                consumer = plan_consumer;
                claim_keys.push(plan.key);
                claim_digests.push(plugin_digest);
            } else {
                items[index] = Some(Ok(ClaimOutcome::Duplicate));
            }
        }
    }
    let mut new_keys = std::collections::HashSet::new();
    if !claim_keys.is_empty() {
        let inserted: Vec<String> = sqlx::query_scalar(BULK_CLAIM_SQL)
            .bind(consumer)
            .bind(&claim_keys)
            .bind(&claim_digests)
            .fetch_all(&mut *transaction)
            .await
            .map_err(|source| classify_transient(source, "claim"))?;
        new_keys.extend(inserted);
    }
    let mut applied = 0;
    for &index in &order {
        let plan = plans[index];
        if items[index].is_some() {
            continue;
        }
        let claimed = bulk(plan);
        if claimed && !new_keys.contains(plan.key) {
            items[index] = Some(Ok(ClaimOutcome::Duplicate));
            continue;
        }
        match apply_steps(&mut transaction, plan, claimed).await {
            Ok(outcome) => {
                if outcome == ClaimOutcome::Applied {
                    applied += 1;
                }
                // Duplicate (natural) and stale changed nothing: no undo needed.
                items[index] = Some(Ok(outcome));
            }
            Err(LedgerError::Effect { .. }) => {
                transaction
                    .rollback()
                    .await
                    .map_err(|source| LedgerError::Transient { source })?;
                return Ok(None);
            }
            Err(transient) => return Err(transient),
        }
    }
    finish_batch(transaction, applied).await?;
    Ok(Some(
        items
            .into_iter()
            .map(|item| item.unwrap_or(Ok(ClaimOutcome::Duplicate)))
            .collect(),
    ))
}

/// Commits a batch that applied something; rolls back one that did not.
async fn finish_batch(
    transaction: Transaction<'static, Postgres>,
    applied: usize,
) -> Result<(), LedgerError> {
    if applied == 0 {
        transaction
            .rollback()
            .await
            .map_err(|source| LedgerError::Transient { source })
    } else {
        Failpoint::BeforeCommit.hit();
        transaction
            .commit()
            .await
            .map_err(|source| classify(source, "commit"))
    }
}

/// The isolating path: a savepoint per message, so a failing message rolls back alone.
async fn apply_batch_isolating(
    pool: &PgPool,
    isolation: Isolation,
    plans: &[&Plan<'_>],
) -> Result<Vec<BatchItem>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let mut transaction = begin(pool, isolation).await?;
    let mut claimed_keys = std::collections::HashSet::new();
    let mut savepoint_open = false;
    let mut applied = 0;
    for index in order {
        let plan = plans[index];
        if matches!(plan.claim, ClaimStrategy::Ledger { .. }) && !claimed_keys.insert(plan.key) {
            items[index] = Some(Ok(ClaimOutcome::Duplicate));
            continue;
        }
        // Release the previous message's savepoint and open this one's in one round trip.
        let savepoint = if savepoint_open {
            "RELEASE SAVEPOINT idem_message; SAVEPOINT idem_message"
        } else {
            "SAVEPOINT idem_message"
        };
        // A plain string runs as a simple query, so both statements go in one round trip.
        sqlx::Executor::execute(&mut *transaction, savepoint)
            .await
            .map_err(|source| classify_transient(source, "savepoint"))?;
        savepoint_open = true;
        let item = match apply_steps(&mut transaction, plan, false).await {
            Ok(ClaimOutcome::Applied) => {
                applied += 1;
                Ok(ClaimOutcome::Applied)
            }
            Ok(outcome) => {
                rollback_to_savepoint(&mut transaction).await?;
                Ok(outcome)
            }
            Err(error @ LedgerError::Effect { .. }) => {
                rollback_to_savepoint(&mut transaction).await?;
                Err(error)
            }
            Err(transient @ LedgerError::Transient { .. }) => return Err(transient),
        };
        items[index] = Some(item);
    }
    finish_batch(transaction, applied).await?;
    Ok(items
        .into_iter()
        .map(|item| item.unwrap_or(Ok(ClaimOutcome::Duplicate)))
        .collect())
}

async fn rollback_to_savepoint(
    transaction: &mut Transaction<'_, Postgres>,
) -> Result<(), LedgerError> {
    sqlx::query("ROLLBACK TO SAVEPOINT idem_message")
        .execute(&mut **transaction)
        .await
        .map(drop)
        .map_err(|source| classify_transient(source, "savepoint"))
}

async fn begin(
    pool: &PgPool,
    isolation: Isolation,
) -> Result<Transaction<'static, Postgres>, LedgerError> {
    let mut transaction = pool
        .begin()
        .await
        .map_err(|source| LedgerError::Transient { source })?;
    if isolation != Isolation::ReadCommitted {
        sqlx::query(&format!(
            "SET TRANSACTION ISOLATION LEVEL {}",
            isolation.sql()
        ))
        .execute(&mut *transaction)
        .await
        .map_err(|source| classify(source, "isolation"))?;
    }
    Ok(transaction)
}

/// The claim (unless `claimed`: taken in bulk already), then (if new) the role, the effects
/// and the outbox rows, inside an open transaction. A duplicate or stale outcome leaves changes for the caller to undo.
async fn apply_steps(
    transaction: &mut Transaction<'_, Postgres>,
    plan: &Plan<'_>,
    claimed: bool,
) -> Result<ClaimOutcome, LedgerError> {
    if let ClaimStrategy::Ledger {
        consumer,
        plugin_digest,
        partitioned,
    } = plan.claim
        && !claimed
    {
        if partitioned {
            sqlx::query(PARTITIONED_LOCK_SQL)
                .bind(consumer)
                .bind(plan.key)
                .execute(&mut **transaction)
                .await
                .map_err(|source| classify(source, "claim"))?;
        }
        let claimed = sqlx::query(if partitioned {
            PARTITIONED_CLAIM_SQL
        } else {
            CLAIM_SQL
        })
        .bind(consumer)
        .bind(plan.key)
        .bind(plugin_digest)
        .execute(&mut **transaction)
        .await
        .map_err(|source| classify(source, "claim"))?
        .rows_affected();
        if claimed == 0 {
            return Ok(ClaimOutcome::Duplicate);
        }
    }
    if let Some(role) = plan.role {
        sqlx::query(&format!("SET LOCAL ROLE {}", quote_identifier(role)))
            .execute(&mut **transaction)
            .await
            .map_err(|source| classify(source, "role"))?;
    }
    let mut rows_changed = 0;
    for (position, effect) in plan.effects.iter().enumerate() {
        let arguments = effect
            .arguments()
            .map_err(|source| classify(source, effect.statement))?;
        let rows = sqlx::query_with(effect.sql, arguments)
            .execute(&mut **transaction)
            .await
            .map_err(|source| classify(source, effect.statement))?
            .rows_affected();
        if position == 0 && rows == 0 && matches!(plan.claim, ClaimStrategy::Natural) {
            return Ok(ClaimOutcome::Duplicate);
        }
        rows_changed += rows;
    }
    if rows_changed == 0 && matches!(plan.claim, ClaimStrategy::None) {
        // Nothing changed: an older or repeated version. Its outbox messages stay unsent.
        return Ok(ClaimOutcome::Stale);
    }
    if plan.role.is_some() {
        // Back to the host's role: for the outbox rows, and for the next message of a batch.
        sqlx::query("RESET ROLE")
            .execute(&mut **transaction)
            .await
            .map_err(|source| classify(source, "role"))?;
    }
    if !plan.outbox.is_empty() {
        outbox::insert(transaction, plan.consumer, plan.key, &plan.outbox)
            .await
            .map_err(|source| classify(source, "outbox"))?;
    }
    Ok(ClaimOutcome::Applied)
}

/// `name` as a quoted SQL identifier.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Serialization failures and deadlocks: the transaction lost a race and may simply be run
/// again. Counted against the pipeline's retry budget, unlike connection errors.
pub fn is_conflict(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(database_error)
        if matches!(database_error.code().as_deref(), Some("40001" | "40P01")))
}

/// A failure of the host's own bookkeeping statements (savepoints): never the message's fault.
fn classify_transient(source: sqlx::Error, statement: &str) -> LedgerError {
    match classify(source, statement) {
        LedgerError::Effect { source, .. } => LedgerError::Transient { source },
        transient => transient,
    }
}

/// Sorts a failure into "try again" or "this message can never apply".
fn classify(source: sqlx::Error, statement: &str) -> LedgerError {
    if is_transient(&source) {
        LedgerError::Transient { source }
    } else {
        LedgerError::Effect {
            statement: statement.to_string(),
            source,
        }
    }
}

/// The SQLSTATE of a transient error, or `connection` when the server gave none: a metric label.
pub fn retry_label(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(database_error) => database_error
            .code()
            .map_or_else(|| "unknown".to_string(), |code| code.into_owned()),
        _ => "connection".to_string(),
    }
}

/// Connection loss, server shutdown, serialization failure and deadlock are transient;
/// constraint, data, syntax and permission errors are the message's own.
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(database_error) => {
            if matches!(
                database_error.kind(),
                ErrorKind::UniqueViolation
                    | ErrorKind::ForeignKeyViolation
                    | ErrorKind::NotNullViolation
                    | ErrorKind::CheckViolation
            ) {
                return false;
            }
            let code = database_error.code().unwrap_or_default();
            // 08: connection exception, 40: transaction rollback (40001, 40P01),
            // 53: insufficient resources, 57P0x: server shutting down, 55P03: lock not available.
            code.starts_with("08")
                || code.starts_with("40")
                || code.starts_with("53")
                || code.starts_with("57P0")
                || code == "55P03"
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}
