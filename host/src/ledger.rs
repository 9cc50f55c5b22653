//! The one transaction per message: claim, effects, commit.
//!
//! Architecture invariant: the claim and the effects share one transaction, and a claim
//! is never committed without its effects. A duplicate claim runs no effect.

use sqlx::PgPool;
use sqlx::error::ErrorKind;

use crate::failpoint::Failpoint;
use crate::statement::BoundEffect;

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

/// The identity of one claim.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub consumer: &'a str,
    pub key: &'a str,
    /// The digest of the plugin build that decided.
    pub plugin_digest: &'a str,
    /// `processed_messages` is partitioned by day (see `partition`).
    pub partitioned: bool,
}

/// Claims `(consumer, key)` and, only if the claim is new, runs `effects`, in one transaction.
pub async fn apply(
    pool: &PgPool,
    claim: Claim<'_>,
    effects: &[BoundEffect<'_>],
) -> Result<ClaimOutcome, LedgerError> {
    let transient = |source| LedgerError::Transient { source };
    let mut transaction = pool.begin().await.map_err(transient)?;
    if claim.partitioned {
        sqlx::query(PARTITIONED_LOCK_SQL)
            .bind(claim.consumer)
            .bind(claim.key)
            .execute(&mut *transaction)
            .await
            .map_err(|source| classify(source, "claim"))?;
    }
    let claim_sql = if claim.partitioned {
        PARTITIONED_CLAIM_SQL
    } else {
        CLAIM_SQL
    };
    let claimed = sqlx::query(claim_sql)
        .bind(claim.consumer)
        .bind(claim.key)
        .bind(claim.plugin_digest)
        .execute(&mut *transaction)
        .await
        .map_err(|source| classify(source, "claim"))?
        .rows_affected();
    if claimed == 0 {
        transaction.commit().await.map_err(transient)?;
        return Ok(ClaimOutcome::Duplicate);
    }
    for effect in effects {
        let arguments = effect
            .arguments()
            .map_err(|source| classify(source, effect.statement))?;
        sqlx::query_with(effect.sql, arguments)
            .execute(&mut *transaction)
            .await
            .map_err(|source| classify(source, effect.statement))?;
    }
    Failpoint::BeforeCommit.hit();
    transaction
        .commit()
        .await
        .map_err(|source| classify(source, "commit"))?;
    Ok(ClaimOutcome::Applied)
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
