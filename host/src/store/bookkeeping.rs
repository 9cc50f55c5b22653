//! How a statement runs on the bookkeeping pool (sqlx): the same directly and behind a
//! transaction pooler (`[database] pooling`).
//!
//! Architecture invariant: a bookkeeping statement is never named (sqlx would keep a
//! `sqlx_s_N` on whichever server connection the pooler lent, where another client's
//! statement of that name collides with it), and every statement with parameters runs
//! inside a transaction: sqlx parses and binds in two exchanges, and between them only an
//! open transaction keeps the pooler from lending the server connection, and its unnamed
//! statement, to another client (`in_transaction`). Statements without parameters may run
//! as `raw`.
//!
//! Their text is idem's own (constants, with idem's table names filled in by
//! `store::tables`): never a value from a message, a plugin or a request, which are always
//! bound as parameters. That is what `AssertSqlSafe` asserts, here and only here.

use sqlx::postgres::{PgArguments, PgConnection, PgRow};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{AssertSqlSafe, FromRow, PgPool, Postgres, RawSql, Transaction};

/// How every bookkeeping transaction opens. The `RESET` first, so the transaction's access
/// mode is the server's configured default (read-only on a fenced primary or a standby),
/// never a session's: idem's sessions default to read-only (`session::GUARD`), and behind a
/// transaction pooler configured as `pooling = "session"` by mistake that setting can sit on
/// the server connection this transaction is lent. The `RESET` clears it there too.
const BEGIN: &str = "RESET default_transaction_read_only; BEGIN";

/// Opens a bookkeeping transaction on `pool` (see `BEGIN`), followed by `settings` (`SET
/// LOCAL`s, or nothing).
pub async fn begin(
    pool: &PgPool,
    settings: &str,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let opening = if settings.is_empty() {
        BEGIN.to_string()
    } else {
        format!("{BEGIN}; {settings}")
    };
    pool.begin_with(AssertSqlSafe(opening)).await
}

/// Runs `work` in a transaction of its own on `pool` (see `begin`), and commits it.
pub async fn in_transaction<T>(
    pool: &PgPool,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let mut transaction = begin(pool, "").await?;
    let value = work(&mut transaction).await?;
    transaction.commit().await?;
    Ok(value)
}

/// `sqlx::query`, unnamed.
pub fn query(sql: &str) -> Query<'static, Postgres, PgArguments> {
    sqlx::query(AssertSqlSafe(sql)).persistent(false)
}

/// `sqlx::query_as`, unnamed.
pub fn query_as<O>(sql: &str) -> QueryAs<'static, Postgres, O, PgArguments>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(AssertSqlSafe(sql)).persistent(false)
}

/// `sqlx::query_scalar`, unnamed.
pub fn query_scalar<O>(sql: &str) -> QueryScalar<'static, Postgres, O, PgArguments>
where
    (O,): for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_scalar(AssertSqlSafe(sql)).persistent(false)
}

/// `sqlx::raw_sql`: statements without parameters, sent as one simple query (several may be
/// separated by `;`).
pub fn raw(sql: &str) -> RawSql {
    sqlx::raw_sql(AssertSqlSafe(sql))
}
