//! How a statement runs on the bookkeeping pool (sqlx): the same directly and behind a
//! transaction pooler (`[database] pooling`).
//!
//! Architecture invariant: a bookkeeping statement is never named (sqlx would keep a
//! `sqlx_s_N` on whichever server connection the pooler lent, where another client's
//! statement of that name collides with it), and every statement with parameters runs
//! inside a transaction: sqlx parses and binds in two exchanges, and between them only an
//! open transaction keeps the pooler from lending the server connection, and its unnamed
//! statement, to another client (`in_transaction`). Statements without parameters may use
//! `sqlx::raw_sql`.

use sqlx::postgres::{PgArguments, PgConnection, PgRow};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{FromRow, PgPool, Postgres};

/// Runs `work` in a transaction of its own on `pool`, and commits it.
pub async fn in_transaction<T>(
    pool: &PgPool,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let mut transaction = pool.begin().await?;
    let value = work(&mut transaction).await?;
    transaction.commit().await?;
    Ok(value)
}

/// `sqlx::query`, unnamed.
pub fn query(sql: &str) -> Query<'_, Postgres, PgArguments> {
    sqlx::query(sql).persistent(false)
}

/// `sqlx::query_as`, unnamed.
pub fn query_as<O>(sql: &str) -> QueryAs<'_, Postgres, O, PgArguments>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(sql).persistent(false)
}

/// `sqlx::query_scalar`, unnamed.
pub fn query_scalar<O>(sql: &str) -> QueryScalar<'_, Postgres, O, PgArguments>
where
    (O,): for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_scalar(sql).persistent(false)
}
