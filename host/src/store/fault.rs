//! Whose fault is a database error? The one classification, shared by every path that runs
//! SQL for a message (one message per transaction, batches, the savepoint path, `COMMIT`).
//!
//! Architecture invariant: a message is rejected only for its own data. Anything the
//! database, the network, the host or the operator's configuration caused keeps the message
//! unacked: retried, or the pipeline paused until the configuration works again.
//!
//! The same question for a connection (`refused_setting`): a refusal no retry can fix names
//! the setting to change and stops the host; anything else is an outage, retried.

use crate::store::session::{POOLER_PROBE, SessionError};

/// Who issued the statement that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// One of the message's own effects (the natural claim statement included), with the
    /// plugin's values, or the `COMMIT` that runs their deferred checks.
    Effect,
    /// The host's own bookkeeping: `BEGIN`, `SET LOCAL ROLE`, savepoints. Its values are
    /// the host's, so its failure is never the message's fault.
    Host,
    /// The host's own statement over values the message gave it: the ledger claim (its key)
    /// and outbox rows (the plugin's key, payload and headers, the producer's trace context).
    /// A data exception (22: a character the server cannot store) or a program limit (54: an
    /// index row too large) comes from those values and is the message's fault; anything
    /// else is the host's.
    Derived,
}

/// What a failure means for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The message's own data can never succeed: dead-letter it.
    Message,
    /// The operator's configuration or schema is wrong (undefined table, permission denied):
    /// pause the pipeline and retry until it works again; the message stays unacked.
    Config,
    /// The database, the network or a race: retry the transaction with backoff.
    Transient,
}

/// SQLSTATE classes raised by the values a statement was given: data exceptions (22),
/// integrity constraints (23), cardinality (21: an upsert touching a row twice), check
/// options (44), program limits (54: an index row too large) and PL/pgSQL raises (P0: a
/// validation trigger).
const MESSAGE_CLASSES: [&str; 6] = ["21", "22", "23", "44", "54", "P0"];

/// The classes of `MESSAGE_CLASSES` a value alone raises, whatever the statement: data
/// exceptions (22) and program limits (54).
const DATA_CLASSES: [&str; 2] = ["22", "54"];

/// SQLSTATE classes that say the configuration or schema is wrong: syntax or access rule
/// (42: undefined table, permission denied), authorization (28), invalid role or grantor
/// (0L, 0P), dependent privileges (2B), routine errors (2F, 38, 39), unknown database or
/// schema (3D, 3F), a prepared statement missing (26: a transaction pooler lent the session
/// another server connection, see `hint`).
const CONFIG_CLASSES: [&str; 11] = [
    "42", "28", "0L", "0P", "2B", "2F", "38", "39", "3D", "3F", "26",
];

/// What a transaction pooler lending a session's transactions other server connections
/// needs (see `session::POOLER_PROBE`).
const POOLER_HINT: &str =
    "a transaction pooler is in front of PostgreSQL: set [database] pooling = \"transaction\"";

/// The pooler's hint, when `message` is the session check's failure.
fn pooler_hint(message: &str) -> Option<&'static str> {
    message.contains(POOLER_PROBE).then_some(POOLER_HINT)
}

/// What to change, for a failure whose cause is known to be one setting.
fn hint(code: &str) -> Option<&'static str> {
    match code {
        // A statement this session prepared is gone, or one of another client is there: the
        // server connection changed between transactions.
        "26000" | "42P05" => Some(POOLER_HINT),
        _ => None,
    }
}

/// A database error as this module reads it: the SQLSTATE and the server's own words, when
/// the server sent an error; both drivers' errors are read the same way.
pub trait DatabaseFailure: std::fmt::Display {
    fn sqlstate(&self) -> Option<String>;
    fn server_message(&self) -> Option<String>;
    /// The server function that raised it (`check_transaction_read_only`): the same in
    /// every language the server speaks, unlike its message.
    fn routine(&self) -> Option<String> {
        None
    }
}

impl DatabaseFailure for sqlx::Error {
    fn sqlstate(&self) -> Option<String> {
        match self {
            sqlx::Error::Database(database_error) => {
                database_error.code().map(|code| code.into_owned())
            }
            _ => None,
        }
    }

    fn server_message(&self) -> Option<String> {
        match self {
            sqlx::Error::Database(database_error) => Some(database_error.message().to_string()),
            _ => None,
        }
    }
}

impl DatabaseFailure for SessionError {
    fn sqlstate(&self) -> Option<String> {
        SessionError::sqlstate(self)
    }

    fn server_message(&self) -> Option<String> {
        self.database_error()
            .map(|database_error| database_error.message().to_string())
    }

    fn routine(&self) -> Option<String> {
        self.database_error()
            .and_then(|database_error| database_error.routine().map(str::to_string))
    }
}

/// Classifies `error`, raised by a statement from `origin`. Connection (08), transaction
/// state (25, a read-only standby), rollback (40), resources (53), object state (55, lock
/// timeouts), operator intervention (57: cancels, shutdowns), system (58), internal (XX) and
/// every class not named above are transient, as is every error the server did not send (a
/// lost connection). 0A000 is transient too: its usual cause is a cached plan outdated by an
/// `ALTER` (the connection is replaced); the caller escalates it to a configuration fault if
/// it persists.
pub fn classify(error: &impl DatabaseFailure, origin: Origin) -> Fault {
    let Some(code) = error.sqlstate() else {
        return Fault::Transient;
    };
    let class = code.get(..2).unwrap_or_default();
    let message_fault = match origin {
        Origin::Effect => Fault::Message,
        Origin::Derived if DATA_CLASSES.contains(&class) => Fault::Message,
        Origin::Derived | Origin::Host => Fault::Transient,
    };
    if MESSAGE_CLASSES.contains(&class) {
        message_fault
    } else if CONFIG_CLASSES.contains(&class) {
        Fault::Config
    } else {
        Fault::Transient
    }
}

/// A cached prepared statement no longer matches the table (`cached plan must not change
/// result type` after an `ALTER`): the connection must be replaced to plan it anew.
pub fn is_stale_plan(error: &impl DatabaseFailure) -> bool {
    error.sqlstate().as_deref() == Some("0A000") && !is_in_recovery(error)
}

/// The server takes no writes (25006: a standby, a demoted primary, or
/// `default_transaction_read_only`; or a standby refusing `BEGIN … READ WRITE`, 0A000).
pub fn is_read_only(error: &impl DatabaseFailure) -> bool {
    error.sqlstate().as_deref() == Some("25006") || is_in_recovery(error)
}

/// A standby refused a read-write transaction (`cannot set transaction read-write mode
/// during recovery`): 0A000 like a stale plan, but from the read-only check, and cured by
/// finding the primary, not by a new plan.
fn is_in_recovery(error: &impl DatabaseFailure) -> bool {
    error.sqlstate().as_deref() == Some("0A000")
        && error.routine().as_deref() == Some("check_transaction_read_only")
}

/// A statement cancelled (57014): by `statement_timeout`, or by an operator.
pub fn is_cancelled(error: &impl DatabaseFailure) -> bool {
    error.sqlstate().as_deref() == Some("57014")
}

/// Serialization failures and deadlocks: the transaction lost a race and may simply be run
/// again. Counted against the pipeline's retry budget, unlike connection errors.
pub fn is_conflict(error: &impl DatabaseFailure) -> bool {
    matches!(error.sqlstate().as_deref(), Some("40001" | "40P01"))
}

/// The SQLSTATE of a retried error, or `connection` when the server gave none: a metric label.
pub fn retry_label(error: &impl DatabaseFailure) -> String {
    error.sqlstate().unwrap_or_else(|| "connection".to_string())
}

/// The database's own words, with its SQLSTATE when it gave one, and what to change when
/// the cause is known.
pub fn describe(error: &impl DatabaseFailure) -> String {
    match (error.server_message(), error.sqlstate()) {
        (Some(message), Some(code)) => match hint(&code).or_else(|| pooler_hint(&message)) {
            Some(hint) => format!("{message} (SQLSTATE {code}); {hint}"),
            None => format!("{message} (SQLSTATE {code})"),
        },
        (Some(message), None) => message,
        _ => error.to_string(),
    }
}

/// The settings to change when TLS cannot be set up as configured.
pub(crate) const TLS_SETTINGS: &str =
    "sslmode, sslrootcert, sslcert and sslkey in [database] url (or [database.tls])";

/// As `refused_setting`, for a session's connection.
pub(crate) fn session_refused_setting(error: &SessionError) -> Option<&'static str> {
    let SessionError::Postgres(postgres_error) = error else {
        return None;
    };
    refused_by_server(error)
        .or_else(|| crate::tls::chain_carries_tls_error(postgres_error).then_some(TLS_SETTINGS))
}

/// The setting to change when the server refused the credentials or the database, or a
/// connection pooler refused a startup parameter (PgBouncer allows only a few unless its
/// `ignore_startup_parameters` lists more).
fn refused_by_server(error: &impl DatabaseFailure) -> Option<&'static str> {
    match error.sqlstate().as_deref() {
        Some("28P01" | "28000") => Some("the user and password in [database] url"),
        Some("3D000") => Some("the database name in [database] url"),
        _ if error
            .server_message()
            .is_some_and(|message| message.contains("unsupported startup parameter")) =>
        {
            Some(
                "the parameters of [database] url (a connection pooler refuses a startup parameter: drop it from the URL, or list it in the pooler's ignore_startup_parameters)",
            )
        }
        _ => None,
    }
}

/// The setting to change when a connection failure is one no retry can fix: the server
/// refused the credentials or the database, or TLS could not be set up as configured. A
/// refused or unreachable address is not among them: it is retried.
pub(crate) fn refused_setting(error: &sqlx::Error) -> Option<&'static str> {
    match error {
        sqlx::Error::Database(_) => refused_by_server(error),
        sqlx::Error::Tls(_) => Some(TLS_SETTINGS),
        // The handshake's verdict (an untrusted or mismatched certificate) arrives as an I/O
        // error carrying the TLS error; a network failure carries none.
        sqlx::Error::Io(io_error) if crate::tls::carries_tls_error(io_error) => Some(TLS_SETTINGS),
        sqlx::Error::Configuration(_) => Some("[database] url"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_transient_from_any_origin() {
        let error = sqlx::Error::Io(std::io::Error::other("reset"));
        assert_eq!(classify(&error, Origin::Effect), Fault::Transient);
        let error = SessionError::Timeout {
            timeout: std::time::Duration::from_secs(5),
            max: 1,
        };
        assert_eq!(classify(&error, Origin::Effect), Fault::Transient);
        assert_eq!(classify(&error, Origin::Host), Fault::Transient);
    }

    /// A server error with `code`, as the classification reads it.
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(formatter, "SQLSTATE {}", self.0)
        }
    }

    impl DatabaseFailure for Coded {
        fn sqlstate(&self) -> Option<String> {
            Some(self.0.to_string())
        }

        fn server_message(&self) -> Option<String> {
            None
        }
    }

    /// A server error with a code and the routine that raised it.
    struct Raised(&'static str, &'static str);

    impl std::fmt::Display for Raised {
        fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(formatter, "SQLSTATE {} from {}", self.0, self.1)
        }
    }

    impl DatabaseFailure for Raised {
        fn sqlstate(&self) -> Option<String> {
            Some(self.0.to_string())
        }

        fn server_message(&self) -> Option<String> {
            None
        }

        fn routine(&self) -> Option<String> {
            Some(self.1.to_string())
        }
    }

    /// A standby's refusal of `BEGIN … READ WRITE` (0A000 from `check_transaction_read_only`)
    /// is read-only, never a stale plan (three of which would pause the pipeline as a
    /// configuration fault during every failover); a plan outdated by an `ALTER` still is.
    #[test]
    fn a_standby_refusing_read_write_is_read_only_not_a_stale_plan() {
        let standby = Raised("0A000", "check_transaction_read_only");
        assert!(is_read_only(&standby));
        assert!(!is_stale_plan(&standby));
        let stale = Raised("0A000", "RevalidateCachedQuery");
        assert!(is_stale_plan(&stale));
        assert!(!is_read_only(&stale));
        assert!(is_read_only(&Coded("25006")));
    }

    /// A character the server cannot store (22021) or an index row too large (54000) in a
    /// claim's key or an outbox row is the message's fault; in the host's own bookkeeping
    /// it is not, and neither is anything but a data class in a claim or an outbox row.
    #[test]
    fn data_faults_of_message_derived_values_are_the_messages() {
        for code in ["22021", "54000", "22001"] {
            assert_eq!(classify(&Coded(code), Origin::Derived), Fault::Message);
            assert_eq!(classify(&Coded(code), Origin::Host), Fault::Transient);
        }
        assert_eq!(classify(&Coded("23502"), Origin::Derived), Fault::Transient);
        assert_eq!(classify(&Coded("57014"), Origin::Derived), Fault::Transient);
        assert_eq!(classify(&Coded("42P01"), Origin::Derived), Fault::Config);
    }

    #[test]
    fn class_lists_do_not_overlap() {
        for class in MESSAGE_CLASSES {
            assert!(!CONFIG_CLASSES.contains(&class), "{class} in both lists");
        }
    }

    fn admin_url() -> String {
        std::env::var("IDEM_TEST_PG_ADMIN_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    }

    async fn connect() -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&admin_url(), tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL (scripts/services.sh starts it)");
        tokio::spawn(connection);
        client
    }

    /// A transaction that a pooler lends another server process than the session's fails
    /// with a configuration fault whose description names `[database] pooling`; on its own
    /// process the check passes.
    #[tokio::test]
    async fn a_transaction_on_another_server_process_fails_naming_the_setting() {
        let own = connect().await;
        let other = connect().await;
        let pid: i32 = own
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid")
            .get(0);
        let check = format!("SELECT {}", crate::store::session::own_backend_check(pid));
        own.simple_query(&check).await.expect("its own process");
        let error = SessionError::from(
            other
                .simple_query(&check)
                .await
                .expect_err("another process"),
        );
        assert_eq!(error.sqlstate().as_deref(), Some("42704"));
        assert_eq!(classify(&error, Origin::Host), Fault::Config);
        let described = describe(&error);
        assert!(described.contains("[database] pooling"), "{described}");
    }
}
