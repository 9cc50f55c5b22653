//! The one transaction per message: claim, effects, outbox rows, commit.
//!
//! Architecture invariant: the claim, the effects and the outbox rows share one transaction,
//! and a claim is never committed without its effects. A duplicate claim runs no effect.
//! Claim strategies: `ledger` (a `processed_messages` row), `natural` (the first effect's
//! unique key decides), `none` (idempotent effects; nothing changed means stale).

use std::time::Duration;

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use futures::future::maybe_done;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

use crate::config::{ClaimMode, Isolation, PipelineConfig, TransactionConfig};
use crate::effect::{Decision, Effect};
use crate::failpoint::Failpoint;
use crate::store::fault::{self, Fault, Origin};
use crate::store::outbox::{OutboxError, OutboxRow};
use crate::store::session::{Prepared, Session, SessionError, SessionPool};
use crate::store::statement::{
    BoundEffect, BoundValue, EffectError, StatementCatalog, values_as_params,
};
use crate::store::tables::{self, MARK_OPEN, Tables, quote_identifier};

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
    Transient { source: SessionError },
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
        source: SessionError,
    },
    /// A statement failed because the configuration or schema is wrong (undefined table,
    /// permission denied): no message can succeed until the operator fixes it.
    #[error("statement {statement:?} failed: {source}")]
    Config {
        statement: String,
        source: SessionError,
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
/// key, insert only if no partition holds the key yet (`Tables::partitioned_claim`). Two
/// statements, because the check must see what a lock holder committed: a statement's
/// snapshot predates its own lock wait.
const PARTITIONED_LOCK_SQL: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2, 0))";
const PARTITIONED_LOCK_TYPES: [Type; 2] = [Type::TEXT, Type::TEXT];

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
    /// The W3C trace context the outbox rows carry to their deliveries (`crate::traces`).
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
    pub fn carry(&mut self, trace: Option<crate::traces::TraceContext>) {
        (self.traceparent, self.tracestate) = match trace {
            Some(trace) => (Some(trace.traceparent), trace.tracestate),
            None => (None, None),
        };
    }
}

/// Runs `plan` in one transaction, bounded by `settings.timeout`. A ledger claim on a session
/// that writes only inside transactions takes one flight (see `one_flight`); otherwise two
/// (see `Flight`): `BEGIN` with the claim, then, only if the claim is new, the effects, the
/// outbox rows and `COMMIT`. Behind a transaction pooler, a natural or `none` claim waits for
/// `BEGIN`'s reply before its first flight (see `open`).
pub async fn apply(
    sessions: &SessionPool,
    settings: &TransactionConfig,
    plan: &Plan<'_>,
) -> Result<ClaimOutcome, LedgerError> {
    let mut session = acquire(sessions).await?;
    let work = apply_on(&mut session, sessions.tables(), settings, plan);
    let result = tokio::time::timeout(settings.timeout, work).await;
    release(session, result, settings.timeout)
}

/// Whether `plan`'s whole transaction leaves in one flight on `session`: `BEGIN`, a claim that
/// aborts the transaction if the key is taken (`Claiming::Aborting`), the effects, the outbox
/// rows and `COMMIT`, one round trip. Only where it is safe and pays:
/// - the session writes nothing outside a transaction block (not behind a transaction
///   pooler), so if `BEGIN` fails the statements behind it write nothing;
/// - the claim is a single unpartitioned ledger row (a partitioned claim or a natural one
///   learns of a duplicate from a row count, which nothing in the flight can read);
/// - the message was not delivered before: a redelivery is likely a duplicate, and a
///   duplicate here costs an error in the server's log for the claim and for each statement
///   behind it, so it asks first.
fn one_flight(session: &Session, plan: &Plan<'_>) -> bool {
    session.writes_only_in_transactions()
        && matches!(
            plan.claim,
            ClaimStrategy::Ledger {
                partitioned: false,
                ..
            }
        )
        && !plan.redelivered
}

async fn apply_on(
    session: &mut Session,
    tables: &Tables,
    settings: &TransactionConfig,
    plan: &Plan<'_>,
) -> Result<ClaimOutcome, LedgerError> {
    let one_flight = one_flight(session, plan);
    let claiming = if one_flight {
        Claiming::Aborting
    } else {
        Claiming::Asking
    };
    let work = Work::prepare(session, tables, plan, claiming).await?;
    let begin = begin_sql(settings, session);
    if one_flight {
        return apply_in_one_flight(session, &work, &begin).await;
    }
    let pipelined = work.may_follow_begin(session.writes_only_in_transactions());
    session.set_in_transaction(true);
    let client = session.client();
    let sent = match open(Flight::new(client), &begin, pipelined).await {
        Ok(mut first) => {
            work.decide(&mut first);
            first.send().await
        }
        Err(error) => Err(error),
    };
    let decided = match sent {
        Ok(replies) => work.outcome(&replies),
        Err(error) => {
            rollback(session).await?;
            return Err(error);
        }
    };
    if decided != ClaimOutcome::Applied {
        // A duplicate or stale message commits nothing.
        rollback(session).await?;
        return Ok(decided);
    }
    Failpoint::BeforeCommit.hit();
    let mut second = Flight::new(client);
    work.finish(&mut second);
    second.commit();
    let sent = second.send().await;
    committed(session, sent)
        .await
        .map(|()| ClaimOutcome::Applied)
}

/// The whole transaction in one flight (see `one_flight`). A taken key fails the claim with
/// 23505: the transaction is aborted, every statement behind the claim fails with it, and
/// `COMMIT` rolls it back; the message is a duplicate. Any other failure is the flight's
/// error, as in two flights. A `COMMIT` that answered ended the transaction, committed or
/// rolled back; one that did not (never sent, or no reply) leaves it to `ROLLBACK`.
async fn apply_in_one_flight(
    session: &mut Session,
    work: &Work<'_>,
    begin: &str,
) -> Result<ClaimOutcome, LedgerError> {
    Failpoint::BeforeCommit.hit();
    session.set_in_transaction(true);
    let mut flight = Flight::new(session.client());
    flight.simple(begin, "begin");
    let claim = flight.steps.len();
    work.decide(&mut flight);
    work.finish(&mut flight);
    flight.commit();
    let landed = flight.land().await;
    let ended = matches!(
        landed.last(),
        Some(Landing {
            reply: Some(Ok(_)),
            ..
        })
    );
    let outcome = match landed.iter().position(Landing::failed) {
        None => {
            let replies: Vec<Reply> = landed
                .into_iter()
                .take(claim + 1)
                .filter_map(|landing| landing.into_result().and_then(Result::ok))
                .collect();
            Ok(work.outcome(&replies))
        }
        Some(step) if step == claim && landed[step].is_taken_key() => Ok(ClaimOutcome::Duplicate),
        Some(step) => Err(landed
            .into_iter()
            .nth(step)
            .and_then(|landing| landing.into_result()?.err())
            .expect("the failed step holds its error")),
    };
    if ended {
        session.set_in_transaction(false);
    } else {
        // Until it succeeds, the session counts as inside a transaction, and is closed.
        let _ = session.rollback().await;
    }
    outcome
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
    sessions: &SessionPool,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Vec<BatchItem>, LedgerError> {
    let mut session = acquire(sessions).await?;
    let tables = sessions.tables();
    let work = async {
        // The fast path takes every claim in one statement; it applies only to unpartitioned
        // ledger claims, whose duplicates are known before any effect writes. Natural and
        // `none` claims learn it from the effects' rows, so they need a savepoint each to
        // undo a duplicate's or a stale message's writes.
        if plans.iter().all(|plan| plan.claim.is_bulk())
            && let Some(items) =
                apply_batch_optimistic(&mut session, tables, settings, plans).await?
        {
            return Ok(items);
        }
        apply_batch_isolating(&mut session, tables, settings, plans).await
    };
    let result = tokio::time::timeout(settings.timeout, work).await;
    release(session, result, settings.timeout)
}

/// Takes a session for one transaction.
async fn acquire(sessions: &SessionPool) -> Result<Session, LedgerError> {
    sessions
        .acquire()
        .await
        .map_err(|source| LedgerError::Transient { source })
}

/// Hands the session back after a transaction, or abandons it: past the deadline (a
/// half-open connection, a hung server) it is closed, never reused, and the next try opens a
/// new one; after an outdated cached plan, a fresh connection plans anew; on a server that
/// takes no writes (a demoted primary), a fresh connection finds the one that does.
fn release<T>(
    session: Session,
    result: Result<Result<T, LedgerError>, tokio::time::error::Elapsed>,
    timeout: Duration,
) -> Result<T, LedgerError> {
    match result {
        Err(_elapsed) => {
            session.detach();
            Err(LedgerError::Deadline { timeout })
        }
        Ok(Err(LedgerError::Transient { source }))
            if fault::is_stale_plan(&source) || fault::is_read_only(&source) =>
        {
            session.detach();
            Err(LedgerError::Transient { source })
        }
        Ok(result) => result,
    }
}

/// The ledger claims of a batch, one statement for all: each key once, in key order.
struct BulkClaim<'a> {
    consumer: &'a str,
    keys: Vec<&'a str>,
    digests: Vec<&'a str>,
}

impl<'a> BulkClaim<'a> {
    /// The claims of `plans` taken in `order`; a repeat of a key is a duplicate already, in
    /// `items`.
    fn of(plans: &[&Plan<'a>], order: &[usize], items: &mut [Option<BatchItem>]) -> Self {
        let mut claim = BulkClaim {
            consumer: "",
            keys: Vec::new(),
            digests: Vec::new(),
        };
        let mut first_of_key = HashSet::new();
        for &index in order {
            let plan = plans[index];
            if let ClaimStrategy::Ledger {
                consumer,
                plugin_digest,
                ..
            } = plan.claim
            {
                if first_of_key.insert(plan.key) {
                    claim.consumer = consumer;
                    claim.keys.push(plan.key);
                    claim.digests.push(plugin_digest);
                } else {
                    items[index] = Some(Ok(ClaimOutcome::Duplicate));
                }
            }
        }
        claim
    }
}

/// The fast path, in two flights: `BEGIN` with all ledger claims in one statement, then
/// every new message's effects with no savepoint, and `COMMIT`. `Ok(None)` when an effect
/// failed for its message's sake: everything was rolled back, and the caller isolates the
/// failure with savepoints.
async fn apply_batch_optimistic(
    session: &mut Session,
    tables: &Tables,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Option<Vec<BatchItem>>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let BulkClaim {
        consumer,
        keys: claim_keys,
        digests: claim_digests,
    } = BulkClaim::of(plans, &order, &mut items);
    let bulk_claim = session
        .statement(&tables.bulk_claim, &tables::BULK_CLAIM_TYPES)
        .await
        .map_err(host_error("claim"))?;
    let mut works = Vec::with_capacity(plans.len());
    for &index in &order {
        if items[index].is_none() {
            works.push((
                index,
                Work::prepare(session, tables, plans[index], Claiming::InBulk).await?,
            ));
        }
    }
    let begin = begin_sql(settings, session);
    let claim_params: [&(dyn ToSql + Sync); 3] = [&consumer, &claim_keys, &claim_digests];
    session.set_in_transaction(true);
    let client = session.client();
    let mut first = Flight::new(client);
    first.simple(&begin, "begin");
    first.query(&bulk_claim, &claim_params, "claim");
    let new_keys: HashSet<String> = match first.send().await {
        Ok(replies) => replies
            .last()
            .map(Reply::returned)
            .unwrap_or_default()
            .iter()
            .map(|row| row.get::<_, String>(0))
            .collect(),
        Err(error) => {
            rollback(session).await?;
            return Err(error);
        }
    };
    let mut applying = Vec::with_capacity(works.len());
    for (index, work) in &works {
        if new_keys.contains(work.plan.key) {
            items[*index] = Some(Ok(ClaimOutcome::Applied));
            applying.push(work);
        } else {
            items[*index] = Some(Ok(ClaimOutcome::Duplicate));
        }
    }
    if applying.is_empty() {
        rollback(session).await?;
    } else {
        Failpoint::BeforeCommit.hit();
        let mut second = Flight::new(client);
        for work in applying {
            work.finish(&mut second);
        }
        second.commit();
        let sent = second.send().await;
        match committed(session, sent).await {
            Ok(()) => {}
            Err(LedgerError::Effect { .. }) => return Ok(None),
            Err(other) => return Err(other),
        }
    }
    Ok(Some(
        items
            .into_iter()
            .map(|item| item.unwrap_or(Ok(ClaimOutcome::Duplicate)))
            .collect(),
    ))
}

/// The savepoint each message of the isolating path runs under.
const SAVEPOINT: &str = "SAVEPOINT idem_message";
const NEXT_SAVEPOINT: &str = "RELEASE SAVEPOINT idem_message; SAVEPOINT idem_message";
/// Undoes the previous message; its savepoint stays, ready for the next one.
const UNDO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idem_message";

/// The isolating path: a savepoint per message, so a failing, duplicate or stale message
/// rolls back alone. Each message takes two flights (its savepoint with its claim, then its
/// effects); the savepoint's release or undo rides with the next message's first flight.
async fn apply_batch_isolating(
    session: &mut Session,
    tables: &Tables,
    settings: &TransactionConfig,
    plans: &[&Plan<'_>],
) -> Result<Vec<BatchItem>, LedgerError> {
    let mut order: Vec<usize> = (0..plans.len()).collect();
    order.sort_by(|left, right| plans[*left].key.cmp(plans[*right].key));
    let mut items: Vec<Option<BatchItem>> = (0..plans.len()).map(|_| None).collect();
    let mut claimed_keys = HashSet::new();
    let mut works = Vec::with_capacity(plans.len());
    for index in order {
        let plan = plans[index];
        if matches!(plan.claim, ClaimStrategy::Ledger { .. }) && !claimed_keys.insert(plan.key) {
            items[index] = Some(Ok(ClaimOutcome::Duplicate));
            continue;
        }
        works.push((
            index,
            Work::prepare(session, tables, plan, Claiming::Asking).await?,
        ));
    }
    let begin = begin_sql(settings, session);
    let guarded = session.writes_only_in_transactions();
    session.set_in_transaction(true);
    match run_isolated(session.client(), &begin, guarded, &works, &mut items).await {
        Ok(isolated) if isolated.applied > 0 => {
            let sent = commit_isolated(session.client(), isolated.undo_last).await;
            committed(session, sent).await?;
        }
        Ok(_) => rollback(session).await?,
        Err(error) => {
            rollback(session).await?;
            return Err(error);
        }
    }
    Ok(items
        .into_iter()
        .map(|item| item.unwrap_or(Ok(ClaimOutcome::Duplicate)))
        .collect())
}

/// Whether the last message of the isolating path kept its writes, or they must be undone
/// before `COMMIT`; and how many messages applied.
struct Isolated {
    applied: usize,
    undo_last: bool,
}

/// Runs every message under its savepoint; `Err` for a failure that fails the batch.
/// `guarded`: the session writes only inside transactions (see `open`).
async fn run_isolated(
    client: &Client,
    begin: &str,
    guarded: bool,
    works: &[(usize, Work<'_>)],
    items: &mut [Option<BatchItem>],
) -> Result<Isolated, LedgerError> {
    let mut prefix = format!("{begin}; {SAVEPOINT}");
    let mut opened = false;
    let mut applied = 0;
    let mut undo_last = false;
    for (index, work) in works {
        let mut first = if opened {
            let mut first = Flight::new(client);
            first.simple(&prefix, "savepoint");
            first
        } else {
            opened = true;
            open(Flight::new(client), &prefix, work.may_follow_begin(guarded)).await?
        };
        work.decide(&mut first);
        let outcome = match first.send().await {
            Ok(replies) => work.outcome(&replies),
            Err(error @ LedgerError::Effect { .. }) => {
                items[*index] = Some(Err(error));
                prefix = UNDO_SAVEPOINT.to_string();
                undo_last = true;
                continue;
            }
            Err(other) => return Err(other),
        };
        let item = if outcome == ClaimOutcome::Applied {
            let mut second = Flight::new(client);
            work.finish(&mut second);
            second.send().await.map(|_| ClaimOutcome::Applied)
        } else {
            Ok(outcome)
        };
        undo_last = match &item {
            Ok(ClaimOutcome::Applied) => false,
            Ok(_) | Err(LedgerError::Effect { .. }) => true,
            Err(_) => return item.map(|_| Isolated { applied, undo_last }),
        };
        if undo_last {
            prefix = UNDO_SAVEPOINT.to_string();
        } else {
            applied += 1;
            prefix = NEXT_SAVEPOINT.to_string();
        }
        items[*index] = Some(item);
    }
    Ok(Isolated { applied, undo_last })
}

/// Commits a batch that applied something, undoing its last message first if it must.
async fn commit_isolated(client: &Client, undo_last: bool) -> Result<Vec<Reply>, LedgerError> {
    let mut last = Flight::new(client);
    if undo_last {
        last.simple(UNDO_SAVEPOINT, "savepoint");
    }
    Failpoint::BeforeCommit.hit();
    last.commit();
    last.send().await
}

/// The statements that open a transaction on `session`: isolation, server-side timeouts, the
/// mark the claims look for (`inside_open_transaction!`) and the check that the transaction
/// runs on the session's own server process (`Session::own_backend_check`), then the
/// session's own settings behind a transaction pooler (`Session::transaction_settings`).
fn begin_sql(settings: &TransactionConfig, session: &Session) -> String {
    begin_sql_with(
        settings,
        session.own_backend_check(),
        session.transaction_settings(),
    )
}

/// `begin_sql` with the session's check and settings given.
fn begin_sql_with(
    settings: &TransactionConfig,
    own_backend: &str,
    session_settings: &str,
) -> String {
    let mut sql = format!("{}, {MARK_OPEN}", opening_sql(settings));
    if !own_backend.is_empty() {
        sql.push_str(", ");
        sql.push_str(own_backend);
    }
    if !session_settings.is_empty() {
        sql.push_str("; ");
        sql.push_str(session_settings);
    }
    sql
}

/// `BEGIN` with the pipeline's isolation, and its server-side timeouts, in one round trip:
/// three statements (every one the server parses and runs costs time on each message), the
/// last a `SELECT` of `set_config`s a caller may add to. The transaction is read-write
/// whatever the session's default (idem's sessions default to read-only, see
/// `session::GUARD`), unless the server's own default is read-only (a primary fenced with
/// `default_transaction_read_only`): then it is read-only, and its writes fail (25006) as
/// any other client's would.
pub fn opening_sql(settings: &TransactionConfig) -> String {
    let isolation = match settings.isolation {
        Isolation::ReadCommitted => "READ COMMITTED",
        Isolation::RepeatableRead => "REPEATABLE READ",
        Isolation::Serializable => "SERIALIZABLE",
    };
    format!(
        "BEGIN ISOLATION LEVEL {isolation} READ WRITE; \
         SET LOCAL default_transaction_read_only TO DEFAULT; \
         SELECT set_config('transaction_read_only', current_setting('default_transaction_read_only'), true), \
         set_config('statement_timeout', '{}', true), set_config('lock_timeout', '{}', true)",
        settings.statement_timeout.as_millis(),
        settings.lock_timeout.as_millis()
    )
}

/// Opens the transaction with `begin`: at the head of `flight` when `pipelined`, that is when
/// what follows it writes nothing outside the transaction (a host claim, or anything on a
/// session that writes only inside transactions); otherwise (a natural or `none` claim
/// decides with the plugin's own statements, which behind a transaction pooler could commit
/// alone if `BEGIN` failed) alone first, waiting for its reply. Returns the flight to add the
/// deciding statements to.
async fn open<'f>(
    mut flight: Flight<'f>,
    begin: &'f str,
    pipelined: bool,
) -> Result<Flight<'f>, LedgerError> {
    if pipelined {
        flight.simple(begin, "begin");
    } else {
        flight
            .client
            .batch_execute(begin)
            .await
            .map_err(|source| classify(source.into(), "begin", Origin::Host))?;
    }
    Ok(flight)
}

/// Ends the open transaction without keeping anything.
async fn rollback(session: &mut Session) -> Result<(), LedgerError> {
    session.rollback().await.map_err(host_error("rollback"))
}

/// How a message's ledger claim learns that the key is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claiming {
    /// Taken already, with every claim of its batch in one statement.
    InBulk,
    /// A taken key changes no row (`ON CONFLICT DO NOTHING`); the effects wait for the count.
    Asking,
    /// A taken key raises 23505 and aborts the transaction, so the effects may follow the
    /// claim in its flight (`one_flight`).
    Aborting,
}

/// One message's statements prepared on the session, with their values.
struct Work<'p> {
    plan: &'p Plan<'p>,
    /// The partition lock and the claim, with their values (ledger claims, unless taken in
    /// bulk).
    claim: Option<(
        Option<Prepared<'static>>,
        Prepared<'p>,
        [&'p (dyn ToSql + Sync); 3],
    )>,
    role: Option<String>,
    /// Each effect's statement as this session prepared it, with its values bound again
    /// when the session's parameter types differ from the catalog's (after a migration).
    effects: Vec<(Prepared<'p>, Option<Vec<BoundValue>>)>,
    outbox: Option<Prepared<'p>>,
}

impl<'p> Work<'p> {
    /// Prepares what `plan` runs (each statement once per session), its ledger claim as
    /// `claiming` says.
    async fn prepare(
        session: &mut Session,
        tables: &'p Tables,
        plan: &'p Plan<'p>,
        claiming: Claiming,
    ) -> Result<Work<'p>, LedgerError> {
        let claim = match &plan.claim {
            ClaimStrategy::Ledger {
                consumer,
                plugin_digest,
                partitioned,
            } if claiming != Claiming::InBulk => {
                let lock = if *partitioned {
                    Some(
                        session
                            .statement(PARTITIONED_LOCK_SQL, &PARTITIONED_LOCK_TYPES)
                            .await
                            .map_err(host_error("claim"))?,
                    )
                } else {
                    None
                };
                let sql = match (partitioned, claiming) {
                    (true, _) => &tables.partitioned_claim,
                    (false, Claiming::Aborting) => &tables.aborting_claim,
                    (false, _) => &tables.claim,
                };
                let statement = session
                    .statement(sql, &tables::CLAIM_TYPES)
                    .await
                    .map_err(host_error("claim"))?;
                let values: [&'p (dyn ToSql + Sync); 3] = [consumer, &plan.key, plugin_digest];
                Some((lock, statement, values))
            }
            _ => None,
        };
        let mut effects = Vec::with_capacity(plan.effects.len());
        for effect in &plan.effects {
            effects.push(Work::prepare_effect(session, effect).await?);
        }
        let outbox = if plan.outbox.is_empty() {
            None
        } else {
            Some(
                session
                    .statement(&tables.outbox_insert, &tables::OUTBOX_INSERT_TYPES)
                    .await
                    .map_err(host_error("outbox"))?,
            )
        };
        Ok(Work {
            plan,
            claim,
            role: plan
                .role
                .map(|role| format!("SET LOCAL ROLE {}", quote_identifier(role))),
            effects,
            outbox,
        })
    }

    /// `effect`'s statement on this session, with its values bound for the types the session
    /// declares. Those are the server's types when the statement was prepared: one prepared
    /// before a migration is prepared again when its types differ from the catalog's, and
    /// the values are bound again for the server's types now (the catalog learns them).
    /// Nothing is sent for a value that does not bind (see `BindError`: a configuration
    /// fault, or the message's for a value out of range). Behind a transaction pooler the
    /// statement is unnamed and declares the values' own types: the server converts them to
    /// its types now, or refuses (42804, a configuration fault).
    async fn prepare_effect(
        session: &mut Session,
        effect: &BoundEffect<'p>,
    ) -> Result<(Prepared<'p>, Option<Vec<BoundValue>>), LedgerError> {
        if !session.names_statements() {
            let unnamed = Prepared::Unnamed {
                sql: effect.sql,
                types: effect.types(),
            };
            return Ok((unnamed, None));
        }
        let failed = |source| classify(source, effect.statement, Origin::Effect);
        let cached = session.has_prepared(effect.sql);
        let mut statement = session.prepared(effect.sql).await.map_err(failed)?;
        if effect.fits(statement.params()) {
            return Ok((Prepared::Named(statement), None));
        }
        if cached {
            statement = session.prepare_again(effect.sql).await.map_err(failed)?;
        }
        let values = effect
            .for_session(statement.params())
            .map_err(|error| failed(error.into()))?;
        Ok((Prepared::Named(statement), Some(values)))
    }

    /// Whether `decide`'s statements may leave in `BEGIN`'s flight (see `open`): a host claim,
    /// which writes nothing outside the transaction `BEGIN` marks (`inside_open_transaction!`),
    /// or anything on a `guarded` session (`Session::writes_only_in_transactions`).
    fn may_follow_begin(&self, guarded: bool) -> bool {
        self.claim.is_some() || guarded
    }

    /// The statements that tell whether the message applies: the ledger claim (after its
    /// partition lock), or the role and the effects a natural or `none` claim reads.
    fn decide<'f>(&'f self, flight: &mut Flight<'f>) {
        match (&self.claim, self.plan.claim) {
            (Some((lock, claim, values)), _) => {
                if let Some(lock) = lock {
                    flight.execute(
                        lock,
                        values.get(..2).unwrap_or_default(),
                        "claim",
                        Origin::Host,
                    );
                }
                flight.execute(claim, values, "claim", Origin::Derived);
            }
            (None, ClaimStrategy::Ledger { .. }) => {}
            (None, ClaimStrategy::Natural) => {
                self.set_role(flight);
                self.effects_from(flight, 0, 1);
            }
            (None, ClaimStrategy::None) => {
                self.set_role(flight);
                self.effects_from(flight, 0, self.effects.len());
            }
        }
    }

    /// The outcome the replies to `decide`'s statements (the flight's last ones) tell.
    fn outcome(&self, replies: &[Reply]) -> ClaimOutcome {
        let rows = |count: usize| {
            replies
                .iter()
                .rev()
                .take(count)
                .map(Reply::rows)
                .sum::<u64>()
        };
        match (&self.claim, self.plan.claim) {
            (Some(_), _) if rows(1) == 0 => ClaimOutcome::Duplicate,
            (None, ClaimStrategy::Natural) if rows(1) == 0 => ClaimOutcome::Duplicate,
            (None, ClaimStrategy::None) if rows(self.effects.len()) == 0 => {
                // Nothing changed: an older or repeated version. Its outbox messages stay
                // unsent.
                ClaimOutcome::Stale
            }
            _ => ClaimOutcome::Applied,
        }
    }

    /// The rest of the message's work once it is known to apply: the effects `decide` did
    /// not run (under the role), back to the host's role, the outbox rows.
    fn finish<'f>(&'f self, flight: &mut Flight<'f>) {
        let ran = match (&self.claim, self.plan.claim) {
            (None, ClaimStrategy::Natural) => 1,
            (None, ClaimStrategy::None) => self.effects.len(),
            _ => {
                self.set_role(flight);
                0
            }
        };
        self.effects_from(flight, ran, self.effects.len());
        if self.role.is_some() {
            // Back to the host's role: for the outbox rows, and the next message of a batch.
            flight.simple("RESET ROLE", "role");
        }
        if let Some(insert) = &self.outbox {
            for row in &self.plan.outbox {
                flight.execute(
                    insert,
                    [
                        &self.plan.consumer as &(dyn ToSql + Sync),
                        &self.plan.key,
                        &row.destination,
                        &row.idempotency_key,
                        &row.payload,
                        &row.headers,
                        &self.plan.traceparent,
                        &self.plan.tracestate,
                    ],
                    "outbox",
                    Origin::Derived,
                );
            }
        }
    }

    fn set_role<'f>(&'f self, flight: &mut Flight<'f>) {
        if let Some(role) = &self.role {
            flight.simple(role, "role");
        }
    }

    fn effects_from<'f>(&'f self, flight: &mut Flight<'f>, from: usize, to: usize) {
        let calls = self.plan.effects.iter().zip(&self.effects);
        for (effect, (statement, rebound)) in calls.skip(from).take(to - from) {
            let values = match rebound {
                Some(values) => values_as_params(values),
                None => effect.params(),
            };
            flight.execute(statement, values, effect.statement, Origin::Effect);
        }
    }
}

/// Statements sent together: every request leaves before the first reply is read, and the
/// server runs them in order, so a flight costs one round trip however many statements it
/// holds. Each statement is synced on its own: after one fails, the rest of the transaction
/// fails with it (25P02), and a `COMMIT` at the end rolls back. The flight's error is its
/// first.
struct Flight<'f> {
    client: &'f Client,
    steps: Vec<Step<'f>>,
}

struct Step<'f> {
    label: &'f str,
    origin: Origin,
    reply: Pin<Box<dyn Future<Output = Result<Reply, tokio_postgres::Error>> + Send + 'f>>,
}

/// A statement's reply.
#[derive(Debug)]
enum Reply {
    /// Rows changed.
    Rows(u64),
    /// Rows returned.
    Returned(Vec<Row>),
}

impl Reply {
    fn rows(&self) -> u64 {
        match self {
            Reply::Rows(rows) => *rows,
            Reply::Returned(rows) => rows.len() as u64,
        }
    }

    fn returned(&self) -> &[Row] {
        match self {
            Reply::Rows(_) => &[],
            Reply::Returned(rows) => rows,
        }
    }
}

impl<'f> Flight<'f> {
    fn new(client: &'f Client) -> Flight<'f> {
        Flight {
            client,
            steps: Vec::new(),
        }
    }

    fn push(
        &mut self,
        label: &'f str,
        origin: Origin,
        reply: impl Future<Output = Result<Reply, tokio_postgres::Error>> + Send + 'f,
    ) {
        self.steps.push(Step {
            label,
            origin,
            reply: Box::pin(reply),
        });
    }

    /// Statements with no parameters (one or several, `;`-separated), as one simple query.
    fn simple(&mut self, sql: &'f str, label: &'f str) {
        let client = self.client;
        self.push(label, Origin::Host, async move {
            client.batch_execute(sql).await.map(|()| Reply::Rows(0))
        });
    }

    fn execute(
        &mut self,
        statement: &'f Prepared<'f>,
        values: impl AsRef<[&'f (dyn ToSql + Sync)]> + Send + 'f,
        label: &'f str,
        origin: Origin,
    ) {
        let client = self.client;
        self.push(label, origin, async move {
            match statement {
                Prepared::Named(statement) => client
                    .execute(statement, values.as_ref())
                    .await
                    .map(Reply::Rows),
                Prepared::Unnamed { sql, types } => {
                    let typed = values.as_ref().iter().copied().zip(types.iter().cloned());
                    let rows = client.query_typed_raw(sql, typed).await?;
                    let mut rows = std::pin::pin!(rows);
                    while futures::TryStreamExt::try_next(&mut rows).await?.is_some() {}
                    Ok(Reply::Rows(rows.rows_affected().unwrap_or(0)))
                }
            }
        });
    }

    fn query(
        &mut self,
        statement: &'f Prepared<'f>,
        values: &'f [&'f (dyn ToSql + Sync)],
        label: &'f str,
    ) {
        let client = self.client;
        self.push(label, Origin::Host, async move {
            match statement {
                Prepared::Named(statement) => client.query(statement, values).await,
                Prepared::Unnamed { sql, types } => {
                    let typed: Vec<_> = values.iter().copied().zip(types.iter().cloned()).collect();
                    client.query_typed(sql, &typed).await
                }
            }
            .map(Reply::Returned)
        });
    }

    /// `COMMIT`: its checks (deferred constraints, serialization) are the effects'.
    fn commit(&mut self) {
        self.simple("COMMIT", "commit");
        if let Some(step) = self.steps.last_mut() {
            step.origin = Origin::Effect;
        }
    }

    /// Sends every statement, in order, then waits for every reply; the flight's error is its
    /// first (see `land`).
    async fn send(self) -> Result<Vec<Reply>, LedgerError> {
        let mut replies = Vec::with_capacity(self.steps.len());
        for landing in self.land().await {
            if let Some(reply) = landing.into_result() {
                replies.push(reply?);
            }
        }
        Ok(replies)
    }

    /// Sends every statement, in order, then waits for every reply, and tells what became of
    /// each. A statement that fails before it leaves (the driver refused a value, the
    /// connection is gone) stops the flight there: nothing after it is sent (its `reply` is
    /// `None`), `COMMIT` least of all, since the server, which never saw the failure, would
    /// commit the statements before it without it.
    async fn land(self) -> Vec<Landing<'f>> {
        let (labels, mut replies): (Vec<_>, Vec<_>) = self
            .steps
            .into_iter()
            .map(|step| ((step.label, step.origin), maybe_done(step.reply)))
            .unzip();
        // A statement's request leaves at its reply's first poll: poll each once, in order,
        // so they leave in the flight's order before any reply is awaited.
        let sent = futures::future::poll_fn(|context| {
            for (index, reply) in replies.iter_mut().enumerate() {
                let _ = Pin::new(&mut *reply).poll(context);
                if matches!(Pin::new(&mut *reply).output_mut(), Some(Err(_))) {
                    return Poll::Ready(index + 1);
                }
            }
            Poll::Ready(replies.len())
        })
        .await;
        let mut landed = Vec::with_capacity(replies.len());
        for (index, ((label, origin), mut reply)) in labels.into_iter().zip(replies).enumerate() {
            // The statements after a refused one were never polled, so never sent.
            let reply = if index < sent {
                (&mut reply).await;
                let output = Pin::new(&mut reply).take_output();
                Some(output.expect("a finished reply holds its output"))
            } else {
                None
            };
            landed.push(Landing {
                label,
                origin,
                reply,
            });
        }
        landed
    }
}

/// What became of one statement of a flight.
struct Landing<'f> {
    label: &'f str,
    origin: Origin,
    /// Its reply, or `None`: never sent.
    reply: Option<Result<Reply, tokio_postgres::Error>>,
}

impl Landing<'_> {
    fn failed(&self) -> bool {
        matches!(self.reply, Some(Err(_)))
    }

    /// A unique violation: from a claim, the key was claimed already.
    fn is_taken_key(&self) -> bool {
        matches!(&self.reply, Some(Err(error)) if error.code() == Some(&SqlState::UNIQUE_VIOLATION))
    }

    /// Its reply, or its failure sorted by whose fault it is; `None`: never sent.
    fn into_result(self) -> Option<Result<Reply, LedgerError>> {
        let (label, origin) = (self.label, self.origin);
        self.reply
            .map(|reply| reply.map_err(|source| classify(source.into(), label, origin)))
    }
}

/// What a flight ending with `COMMIT` leaves: when it failed, `COMMIT` may never have left
/// (see `Flight::send`), so the transaction is rolled back, which does nothing if `COMMIT`
/// ended it already; if even that fails, the session stays marked inside a transaction and
/// is closed, never reused.
async fn committed(
    session: &mut Session,
    sent: Result<Vec<Reply>, LedgerError>,
) -> Result<(), LedgerError> {
    match sent {
        Ok(_) => {
            session.set_in_transaction(false);
            Ok(())
        }
        Err(error) => {
            let _ = session.rollback().await;
            Err(error)
        }
    }
}

/// Maps a failure of the host's own statement `statement` to its error.
fn host_error(statement: &'static str) -> impl Fn(SessionError) -> LedgerError {
    move |source| classify(source, statement, Origin::Host)
}

/// Sorts a failure by whose fault it is (see `fault`).
fn classify(source: SessionError, statement: &str, origin: Origin) -> LedgerError {
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

#[cfg(test)]
mod steps;

#[cfg(test)]
mod tests {
    use super::*;

    /// The server the test suite runs against (`scripts/services.sh` starts it).
    pub(super) fn admin_url() -> String {
        std::env::var("IDEM_TEST_PG_ADMIN_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    }

    /// A statement the driver refuses to send (a value of another type than its parameter's,
    /// as after a migration) stops its flight: `COMMIT` never leaves, so the statements
    /// before it are not committed without it; the refusal is a configuration fault.
    #[tokio::test]
    async fn a_statement_refused_before_it_leaves_stops_the_flight() {
        let (client, connection) = tokio_postgres::connect(&admin_url(), tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL (scripts/services.sh starts it)");
        let driver = tokio::spawn(connection);
        client
            .batch_execute("CREATE TEMPORARY TABLE flight_rows (n int8)")
            .await
            .expect("temporary table");
        let insert = Prepared::Named(
            client
                .prepare("INSERT INTO flight_rows (n) VALUES ($1)")
                .await
                .expect("prepare"),
        );
        let (one, two, refused) = (1_i64, 2_i64, 3_i32);
        let mut flight = Flight::new(&client);
        flight.simple("BEGIN", "begin");
        flight.execute(
            &insert,
            [&one as &(dyn ToSql + Sync)],
            "first",
            Origin::Effect,
        );
        flight.execute(
            &insert,
            [&refused as &(dyn ToSql + Sync)],
            "refused",
            Origin::Effect,
        );
        flight.execute(
            &insert,
            [&two as &(dyn ToSql + Sync)],
            "after",
            Origin::Effect,
        );
        flight.commit();
        let error = flight
            .send()
            .await
            .expect_err("an int4 value for an int8 parameter");
        assert!(
            matches!(&error, LedgerError::Config { statement, .. } if statement == "refused"),
            "{error:?}"
        );
        client.batch_execute("ROLLBACK").await.expect("rollback");
        let rows = client
            .query_one("SELECT count(*) FROM flight_rows", &[])
            .await
            .expect("count");
        assert_eq!(
            rows.get::<_, i64>(0),
            0,
            "the flight committed around a refused statement"
        );
        drop(client);
        driver.await.expect("driver").expect("connection");
    }

    /// Every host claim, run as if its flight's `BEGIN` had failed (outside any transaction),
    /// writes nothing; run after `begin_sql`, it claims. On a temporary `processed_messages`,
    /// which shadows any other for this connection alone.
    #[tokio::test]
    async fn claims_write_nothing_outside_the_open_transaction() {
        let (client, connection) = tokio_postgres::connect(&admin_url(), tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL (scripts/services.sh starts it)");
        let driver = tokio::spawn(connection);
        client
            .batch_execute(
                "CREATE TEMPORARY TABLE processed_messages (consumer text, message_key text, \
                 plugin_digest text, PRIMARY KEY (consumer, message_key))",
            )
            .await
            .expect("temporary ledger");
        let begin = begin_sql_with(&TransactionConfig::default(), "", "");
        let keys = vec!["k".to_string()];
        let digests = vec!["d".to_string()];
        let tables = Tables::new(None);
        let claims: [(&str, [&(dyn ToSql + Sync); 3]); 3] = [
            (&tables.claim, [&"c", &"k", &"d"]),
            (&tables.partitioned_claim, [&"c", &"k", &"d"]),
            (&tables.bulk_claim, [&"c", &keys, &digests]),
        ];
        for (sql, values) in claims {
            let alone = client.execute(sql, &values).await.expect("claim alone");
            assert_eq!(alone, 0, "claimed outside the transaction: {sql}");
            client.batch_execute(&begin).await.expect("begin");
            let inside = client.execute(sql, &values).await.expect("claim inside");
            assert_eq!(inside, 1, "no claim inside the transaction: {sql}");
            client.batch_execute("ROLLBACK").await.expect("rollback");
            let marked = client
                .query_one("SELECT current_setting('idem.transaction', true)", &[])
                .await
                .expect("mark");
            assert_ne!(marked.get::<_, Option<String>>(0).as_deref(), Some("open"));
        }
        drop(client);
        driver.await.expect("driver").expect("connection");
    }
}
