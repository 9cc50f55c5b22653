//! The one transaction per message: claim, effects, outbox rows, commit.
//!
//! Architecture invariant: the claim, the effects and the outbox rows share one transaction,
//! and a claim is never committed without its effects. A duplicate claim runs no effect.
//! Claim strategies: `ledger` (a `processed_messages` row), `natural` (the first effect's
//! unique key decides), `none` (idempotent effects; nothing changed means stale).

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};

use crate::config::{ClaimMode, PipelineConfig, TransactionConfig};
use crate::effect::{Decision, Effect};
use crate::failpoint::Failpoint;
use crate::fault::{self, Fault, Origin};
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

/// Why a transaction did not finish. Which variant an error becomes is decided in one place,
/// `fault::classify`.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The database is unreachable, read-only, restarting, cancelled us or asked us to retry
    /// (40001, 40P01): nothing was committed, and the same message may be tried again.
    #[error("database unavailable: {source}")]
    Transient { source: sqlx::Error },
    /// The host's deadline for the transaction passed (a half-open connection, a hung
    /// server): the connection was abandoned; nothing was committed that the claim would not
    /// recognise.
    #[error("the transaction did not finish within {timeout:?}; its connection was abandoned")]
    Deadline { timeout: Duration },
    /// An effect failed for its message's data (SQLSTATE 22, 23 …): the claim rolled back
    /// with it.
    #[error("statement {statement:?} failed: {source}")]
    Effect {
        statement: String,
        source: sqlx::Error,
    },
    /// A statement failed because the configuration or schema is wrong (undefined table,
    /// permission denied): no message can succeed until the operator fixes it.
    #[error("statement {statement:?} failed: {source}")]
    Config {
        statement: String,
        source: sqlx::Error,
    },
}

impl LedgerError {
    /// Retried (transient, past the deadline, or a configuration fault that pauses the
    /// pipeline) rather than settling the message.
    pub fn is_retried(&self) -> bool {
        !matches!(self, LedgerError::Effect { .. })
    }
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

impl ClaimStrategy<'_> {
    /// A claim the batch fast path takes in one statement for every message.
    fn is_bulk(&self) -> bool {
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
        })
    }
}

/// Runs `plan` in one transaction: the claim, and only if it is new, the effects and the
/// outbox rows; then commit. The whole transaction is bounded by `settings.timeout`.
pub async fn apply(
    pool: &PgPool,
    settings: &TransactionConfig,
    plan: &Plan<'_>,
) -> Result<ClaimOutcome, LedgerError> {
    let mut connection = acquire(pool).await?;
    let result =
        tokio::time::timeout(settings.timeout, apply_on(&mut connection, settings, plan)).await;
    release(connection, result, settings.timeout)
}

async fn apply_on(
    connection: &mut PgConnection,
    settings: &TransactionConfig,
    plan: &Plan<'_>,
) -> Result<ClaimOutcome, LedgerError> {
    let mut transaction = begin(connection, settings).await?;
    let outcome = apply_steps(&mut transaction, plan, false).await?;
    if outcome != ClaimOutcome::Applied {
        // A duplicate or stale message commits nothing.
        transaction
            .rollback()
            .await
            .map_err(host_error("rollback"))?;
        return Ok(outcome);
    }
    Failpoint::BeforeCommit.hit();
    transaction
        .commit()
        .await
        .map_err(|source| classify(source, "commit", Origin::Effect))?;
    Ok(outcome)
}

/// How one message of a batch ended inside the batch's transaction.
pub type BatchItem = Result<ClaimOutcome, LedgerError>;

/// Runs `plans` in ONE transaction. Ledger claims are taken in key order, so two batches
/// never deadlock on claims, and a key repeated within the batch is a duplicate without a
/// round trip. If a message's effect fails, the batch is run again with a savepoint per
/// message: that message rolls back to its savepoint (its item is `Err(LedgerError::Effect)`)
/// and the others commit. A transient or configuration error fails the whole batch (`Err`),
/// to be retried as a whole. Bounded by `settings.timeout`, like one message.
pub async fn apply_batch(
    pool: &PgPool,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Vec<BatchItem>, LedgerError> {
    let mut connection = acquire(pool).await?;
    let work = async {
        // The fast path takes every claim in one statement; it applies only to unpartitioned
        // ledger claims, whose duplicates are known before any effect writes. Natural and
        // `none` claims learn it from the effects' rows, so they need a savepoint each to
        // undo a duplicate's or a stale message's writes.
        if plans.iter().all(|plan| plan.claim.is_bulk())
            && let Some(items) = apply_batch_optimistic(&mut connection, settings, plans).await?
        {
            return Ok(items);
        }
        apply_batch_isolating(&mut connection, settings, plans).await
    };
    let result = tokio::time::timeout(settings.timeout, work).await;
    release(connection, result, settings.timeout)
}

/// Takes a pooled connection for one transaction.
async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>, LedgerError> {
    pool.acquire()
        .await
        .map_err(|source| LedgerError::Transient { source })
}

/// Hands the connection back after a transaction, or abandons it: past the deadline (a
/// half-open connection, a hung server) it is closed, never reused, and the next try opens a
/// new one; after an outdated cached plan, a fresh connection plans anew.
fn release<T>(
    connection: PoolConnection<Postgres>,
    result: Result<Result<T, LedgerError>, tokio::time::error::Elapsed>,
    timeout: Duration,
) -> Result<T, LedgerError> {
    match result {
        Err(_elapsed) => {
            drop(connection.detach());
            Err(LedgerError::Deadline { timeout })
        }
        Ok(Err(LedgerError::Transient { source })) if fault::is_stale_plan(&source) => {
            drop(connection.detach());
            Err(LedgerError::Transient { source })
        }
        Ok(result) => result,
    }
}

/// The claims of every ledger plan in one statement, in byte order of the key (the order
/// every host and the savepoint path take them in); returns the keys that were new.
const BULK_CLAIM_SQL: &str = "INSERT INTO processed_messages (consumer, message_key, plugin_digest) \
     SELECT $1, claim.key, claim.digest FROM unnest($2::text[], $3::text[]) AS claim(key, digest) \
     ORDER BY claim.key COLLATE \"C\" \
     ON CONFLICT DO NOTHING RETURNING message_key";

/// The fast path: all ledger claims in one round trip, then each new message's effects with
/// no savepoint. `Ok(None)` when an effect failed for its message's sake: everything was
/// rolled back, and the caller isolates the failure with savepoints.
async fn apply_batch_optimistic(
    connection: &mut PgConnection,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Option<Vec<BatchItem>>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let mut transaction = begin(connection, settings).await?;
    let mut claim_keys = Vec::new();
    let mut claim_digests = Vec::new();
    let mut consumer = "";
    let mut first_of_key = std::collections::HashSet::new();
    for &index in &order {
        let plan = plans[index];
        if let ClaimStrategy::Ledger {
            consumer: plan_consumer,
            plugin_digest,
            ..
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
            .map_err(host_error("claim"))?;
        new_keys.extend(inserted);
    }
    let mut applied = 0;
    for &index in &order {
        let plan = plans[index];
        if items[index].is_some() {
            continue;
        }
        if !new_keys.contains(plan.key) {
            items[index] = Some(Ok(ClaimOutcome::Duplicate));
            continue;
        }
        match apply_steps(&mut transaction, plan, true).await {
            Ok(outcome) => {
                if outcome == ClaimOutcome::Applied {
                    applied += 1;
                }
                items[index] = Some(Ok(outcome));
            }
            Err(LedgerError::Effect { .. }) => {
                transaction
                    .rollback()
                    .await
                    .map_err(host_error("rollback"))?;
                return Ok(None);
            }
            Err(other) => return Err(other),
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
    transaction: Transaction<'_, Postgres>,
    applied: usize,
) -> Result<(), LedgerError> {
    if applied == 0 {
        transaction.rollback().await.map_err(host_error("rollback"))
    } else {
        Failpoint::BeforeCommit.hit();
        transaction
            .commit()
            .await
            .map_err(|source| classify(source, "commit", Origin::Effect))
    }
}

/// The isolating path: a savepoint per message, so a failing, duplicate or stale message
/// rolls back alone.
async fn apply_batch_isolating(
    connection: &mut PgConnection,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Vec<BatchItem>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let mut transaction = begin(connection, settings).await?;
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
            .map_err(host_error("savepoint"))?;
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
            Err(other) => return Err(other),
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
        .map_err(host_error("savepoint"))
}

/// Opens the transaction with its isolation and server-side timeouts, in one round trip.
async fn begin<'c>(
    connection: &'c mut PgConnection,
    settings: &TransactionConfig,
) -> Result<Transaction<'c, Postgres>, LedgerError> {
    connection
        .begin_with(settings.begin_sql())
        .await
        .map_err(host_error("begin"))
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
                .map_err(host_error("claim"))?;
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
        .map_err(host_error("claim"))?
        .rows_affected();
        if claimed == 0 {
            return Ok(ClaimOutcome::Duplicate);
        }
    }
    if let Some(role) = plan.role {
        sqlx::query(&format!("SET LOCAL ROLE {}", quote_identifier(role)))
            .execute(&mut **transaction)
            .await
            .map_err(host_error("role"))?;
    }
    let mut rows_changed = 0;
    for (position, effect) in plan.effects.iter().enumerate() {
        let arguments = effect
            .arguments()
            .map_err(|source| classify(source, effect.statement, Origin::Effect))?;
        let rows = sqlx::query_with(effect.sql, arguments)
            .execute(&mut **transaction)
            .await
            .map_err(|source| classify(source, effect.statement, Origin::Effect))?
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
            .map_err(host_error("role"))?;
    }
    if !plan.outbox.is_empty() {
        outbox::insert(transaction, plan.consumer, plan.key, &plan.outbox)
            .await
            .map_err(host_error("outbox"))?;
    }
    Ok(ClaimOutcome::Applied)
}

/// `name` as a quoted SQL identifier.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Maps a failure of the host's own statement `statement` to its error.
fn host_error(statement: &'static str) -> impl Fn(sqlx::Error) -> LedgerError {
    move |source| classify(source, statement, Origin::Host)
}

/// Sorts a failure by whose fault it is (see `fault`).
fn classify(source: sqlx::Error, statement: &str, origin: Origin) -> LedgerError {
    match fault::classify(&source, origin) {
        Fault::Transient => LedgerError::Transient { source },
        Fault::Message => LedgerError::Effect {
            statement: statement.to_string(),
            source,
        },
        Fault::Config => LedgerError::Config {
            statement: statement.to_string(),
            source,
        },
    }
}
