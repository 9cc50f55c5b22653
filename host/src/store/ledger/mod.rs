//! The one transaction per message: claim, effects, outbox rows, commit.
//!
//! Architecture invariant: the claim, the effects and the outbox rows share one transaction,
//! and a claim is never committed without its effects. A duplicate claim runs no effect.
//! Claim strategies: `ledger` (a `processed_messages` row), `natural` (the first effect's
//! unique key decides), `none` (idempotent effects; nothing changed means stale).
//!
//! Here: `apply` and `apply_batch`, and the opening every transaction shares. `plan` decides
//! what a message's transaction will do; `work` lays its statements out on a session;
//! `single` runs one message, `batch` several; `flight` sends statements before their
//! replies and reads what landed.

mod batch;
mod flight;
mod plan;
mod single;
mod work;

pub use plan::{ClaimStrategy, Plan, PlanError};

use std::time::Duration;

use crate::config::{Isolation, TransactionConfig};
use crate::store::fault::{self, Origin};
use crate::store::session::{Session, SessionError, SessionPool};
use crate::store::tables::MARK_OPEN;

use batch::{apply_batch_isolating, apply_batch_optimistic};
use flight::{Flight, classify, host_error};
use single::apply_on;

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
            .client()
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

#[cfg(test)]
mod steps;

#[cfg(test)]
mod tests {
    use tokio_postgres::types::ToSql;

    use super::*;
    use crate::store::session::Prepared;
    use crate::store::tables::Tables;

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
