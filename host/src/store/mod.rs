//! PostgreSQL: everything the host keeps in the database and how it gets there.
//!
//! - [`ledger`]: the one transaction per message (or batch): claim, effects, outbox rows,
//!   commit, in pipelined flights.
//! - [`statement`]: the named statements, prepared at start-up; effects checked against them.
//! - [`binding`]: a value that does not bind to its parameter's type.
//! - [`session`]: the pooled tokio-postgres connections the transactions run on.
//! - [`fault`]: whose fault a database error is: reject the message, retry, or pause.
//! - [`outbox`]: outbox rows, and the relay that delivers them after commit.
//! - [`retention`], [`partition`]: old claims deleted in batches, or daily partitions dropped
//!   whole.
//! - [`pauses`]: operator pauses recorded for every host of a consumer; [`archive`]: dead
//!   letters an operator archived; [`offsets`]: where each consumer resumes in a log read by
//!   offset (Kafka).
//! - [`database`]: connecting (URL, TLS, libpq's environment), the bookkeeping pool,
//!   migrations, the schema check.
//! - [`primary`]: which host of a multi-host URL takes writes, for the bookkeeping pool.
//! - [`bookkeeping`]: how a statement runs on the bookkeeping pool, safely behind a
//!   transaction pooler.
//! - [`tables`]: where idem's own tables are (`[database] schema`), and the statements that
//!   name them.

pub mod archive;
pub mod binding;
pub mod bookkeeping;
pub mod database;
pub mod fault;
pub mod ledger;
pub mod offsets;
pub mod outbox;
pub mod partition;
pub mod pauses;
pub mod primary;
pub mod retention;
pub mod session;
pub mod statement;
pub mod tables;
