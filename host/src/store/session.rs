//! Sessions: the PostgreSQL connections the message transactions run on, pooled.
//!
//! They are tokio-postgres connections because it pipelines: the statements of a flight
//! (`ledger`) leave together and their replies come back together, one round trip for many
//! statements, which sqlx cannot do. Each session prepares a statement once and keeps it,
//! unless a transaction pooler stands in front (`Setup::PerTransaction`): then nothing may
//! outlive a transaction, and every statement is parsed with its execution, unnamed, with
//! the parameter types the caller gives (`Prepared::Unnamed`). `database` decides where and
//! how they connect (URL, TLS, keepalives, server settings) and opens this pool beside
//! sqlx's bookkeeping pool; nothing else opens a session.
//!
//! A session that may be inside a transaction (a transaction abandoned mid-way, past its
//! deadline, or whose future was dropped) is closed, never handed out again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;
use tracing::debug;

use crate::store::binding::BindError;
use crate::store::tables::Tables;

/// A session of its own defaults to read-only transactions: a statement that runs outside
/// the transaction its flight opened (because `BEGIN` failed, was cancelled, or the server
/// lost it) runs in a read-only transaction of its own and writes nothing. Each message
/// transaction opens read-write unless the server itself defaults to read-only
/// (`ledger::opening_sql`), so a whole transaction may leave in one flight
/// (`writes_only_in_transactions`). Not behind a transaction pooler, where no session
/// setting lasts; nor on the bookkeeping pool, whose statements are sqlx's own.
pub(crate) const GUARD: &str = "SET default_transaction_read_only = on";

/// How long taking a session may wait, for a free one or for a new connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why no session could be had, or a statement failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error(
        "no PostgreSQL session within {timeout:?}: all {max} are busy, or the server does not answer"
    )]
    Timeout { timeout: Duration, max: u32 },
    /// A value does not bind to the type the session's statement declares; nothing was sent.
    #[error(transparent)]
    Bind(#[from] BindError),
}

impl SessionError {
    /// The server's error, when the server sent one.
    pub fn database_error(&self) -> Option<&tokio_postgres::error::DbError> {
        match self {
            SessionError::Postgres(error) => error.as_db_error(),
            SessionError::Timeout { .. } | SessionError::Bind(_) => None,
        }
    }

    /// The SQLSTATE of the failure: the server's, or the one the server would have raised for
    /// a value the client refused to send (a type mismatch is 42804, a value out of the
    /// type's range 22003).
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            SessionError::Bind(error) => Some(error.sqlstate().to_string()),
            SessionError::Postgres(error) => match error.as_db_error() {
                Some(database_error) => Some(database_error.code().code().to_string()),
                None => is_wrong_type(error).then(|| "42804".to_string()),
            },
            SessionError::Timeout { .. } => None,
        }
    }
}

/// Whether the driver refused to encode a value for its parameter's type (the statement was
/// never sent).
fn is_wrong_type(error: &tokio_postgres::Error) -> bool {
    let mut cause = std::error::Error::source(error);
    while let Some(error) = cause {
        if error.is::<tokio_postgres::types::WrongType>() {
            return true;
        }
        cause = error.source();
    }
    false
}

/// The pool of sessions, shared by every pipeline; cheap to clone.
#[derive(Clone)]
pub struct SessionPool {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SessionPool {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SessionPool")
            .field("max", &self.shared.max)
            .finish_non_exhaustive()
    }
}

/// Where a session's server settings are set (see `database::setup`), and so whether a
/// session may keep prepared statements.
#[derive(Debug, Clone)]
pub(crate) enum Setup {
    /// `SET`s sent once, when a connection opens: it is the server's own session.
    PerConnection(String),
    /// `SET LOCAL`s that open every transaction (`Session::transaction_settings`), and no
    /// named statement: behind a transaction pooler, the server connection may change
    /// after every transaction.
    PerTransaction(String),
}

/// A statement as a session runs it.
#[derive(Debug, Clone)]
pub enum Prepared<'s> {
    /// Prepared once on this connection and kept; its parameter types are the server's.
    Named(Statement),
    /// Parsed again with each execution, as the unnamed statement, with these parameter
    /// types: nothing of it outlives the transaction.
    Unnamed { sql: &'s str, types: Vec<Type> },
}

impl Prepared<'_> {
    /// The parameter types values are bound for.
    pub fn params(&self) -> &[Type] {
        match self {
            Prepared::Named(statement) => statement.params(),
            Prepared::Unnamed { types, .. } => types,
        }
    }
}

struct Shared {
    config: tokio_postgres::Config,
    /// Where idem's own tables are in the sessions' database.
    tables: Arc<Tables>,
    setup: Setup,
    /// `None` when TLS is off (`sslmode=disable` or `allow`).
    tls: Option<MakeRustlsConnect>,
    idle: Mutex<Vec<Connection>>,
    permits: Arc<Semaphore>,
    max: u32,
}

/// One connection: its client, the task driving its socket, its prepared statements.
struct Connection {
    client: Client,
    driver: tokio::task::JoinHandle<()>,
    prepared: HashMap<String, Statement>,
    /// The expression a transaction's opening `SELECT` adds to fail (42704, a configuration
    /// fault) unless it runs on this connection's own server process: a transaction pooler
    /// left at `[database] pooling = "none"` lends each transaction whichever server
    /// connection is free, and the session's settings (its `GUARD`) stay behind on the one
    /// they were set on. Empty behind a pooler configured as one.
    own_backend: String,
}

/// The setting named when a transaction lands on another server process than its session's
/// (see `Connection::own_backend`): unset anywhere, so reading it fails, naming it.
pub(crate) const POOLER_PROBE: &str = "idem.session_moved_to_another_server_connection";

/// An expression that is empty text on server process `pid`, and fails with 42704 naming
/// `POOLER_PROBE` on any other.
pub(crate) fn own_backend_check(pid: i32) -> String {
    format!("CASE WHEN pg_backend_pid() = {pid} THEN '' ELSE current_setting('{POOLER_PROBE}') END")
}

impl SessionPool {
    /// A pool of at most `max` sessions connecting with `config`, to a database with idem's
    /// tables where `tables` says; opens none yet.
    pub(crate) fn new(
        config: tokio_postgres::Config,
        tables: Arc<Tables>,
        setup: Setup,
        tls: Option<MakeRustlsConnect>,
        max: u32,
    ) -> SessionPool {
        SessionPool {
            shared: Arc::new(Shared {
                config,
                tables,
                setup,
                tls,
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(max as usize)),
                max,
            }),
        }
    }

    /// Takes an idle session, or opens one; waits at most five seconds.
    pub async fn acquire(&self) -> Result<Session, SessionError> {
        let shared = &self.shared;
        let taking = async {
            let permit = Arc::clone(&shared.permits)
                .acquire_owned()
                .await
                .expect("the session semaphore is never closed");
            let idle = loop {
                let Some(connection) = shared.idle.lock().expect("idle sessions").pop() else {
                    break None;
                };
                if !connection.client.is_closed() {
                    break Some(connection);
                }
            };
            let connection = match idle {
                Some(connection) => connection,
                None => shared.connect().await?,
            };
            Ok(Session {
                connection: Some(connection),
                shared: Arc::clone(shared),
                in_transaction: false,
                _permit: permit,
            })
        };
        tokio::time::timeout(ACQUIRE_TIMEOUT, taking)
            .await
            .unwrap_or(Err(SessionError::Timeout {
                timeout: ACQUIRE_TIMEOUT,
                max: shared.max,
            }))
    }

    /// Where idem's own tables are in the sessions' database.
    pub fn tables(&self) -> &Tables {
        &self.shared.tables
    }

    /// Closes the idle sessions (at shutdown); sessions in use close when returned.
    pub fn close_idle(&self) {
        self.shared.idle.lock().expect("idle sessions").clear();
    }
}

impl Shared {
    async fn connect(&self) -> Result<Connection, SessionError> {
        let (client, driver) = match &self.tls {
            Some(tls) => {
                let (client, connection) = self.config.connect(tls.clone()).await?;
                (client, tokio::spawn(drive(connection)))
            }
            None => {
                let (client, connection) = self.config.connect(NoTls).await?;
                (client, tokio::spawn(drive(connection)))
            }
        };
        let mut own_backend = String::new();
        if let Setup::PerConnection(settings) = &self.setup {
            let replies = client
                .simple_query(&format!("{settings}; {GUARD}; SELECT pg_backend_pid()"))
                .await?;
            let pid = replies.iter().find_map(|reply| match reply {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
                _ => None,
            });
            if let Some(pid) = pid.and_then(|pid| pid.parse().ok()) {
                own_backend = own_backend_check(pid);
            }
        }
        Ok(Connection {
            client,
            driver,
            prepared: HashMap::new(),
            own_backend,
        })
    }
}

/// Runs a connection's socket until the client is dropped or the connection fails.
async fn drive<S, T>(connection: tokio_postgres::Connection<S, T>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    if let Err(error) = connection.await {
        debug!(%error, "A PostgreSQL session ended.");
    }
}

/// A session taken from the pool; back to the pool when dropped, unless it may be inside a
/// transaction or its connection is gone.
pub struct Session {
    connection: Option<Connection>,
    shared: Arc<Shared>,
    in_transaction: bool,
    _permit: OwnedSemaphorePermit,
}

impl Session {
    pub fn client(&self) -> &Client {
        &self.connection().client
    }

    fn connection(&self) -> &Connection {
        self.connection
            .as_ref()
            .expect("a session holds its connection until dropped")
    }

    /// `sql` as this session runs it: prepared and kept (see `prepared`), or, behind a
    /// transaction pooler, the unnamed statement with `types` for its parameters.
    pub async fn statement<'s>(
        &mut self,
        sql: &'s str,
        types: &[Type],
    ) -> Result<Prepared<'s>, SessionError> {
        if self.names_statements() {
            self.prepared(sql).await.map(Prepared::Named)
        } else {
            Ok(Prepared::Unnamed {
                sql,
                types: types.to_vec(),
            })
        }
    }

    /// Whether this session may keep prepared statements (no transaction pooler in front).
    pub fn names_statements(&self) -> bool {
        matches!(self.shared.setup, Setup::PerConnection(_))
    }

    /// Whether a statement this session runs outside a transaction block writes nothing (the
    /// connection defaults to read-only transactions, see `GUARD`): then the
    /// statements after `BEGIN` may leave before its reply, since if it failed they fail too.
    /// Not behind a transaction pooler, where no session setting lasts.
    pub fn writes_only_in_transactions(&self) -> bool {
        matches!(self.shared.setup, Setup::PerConnection(_))
    }

    /// An expression the opening `SELECT` of every transaction adds, which fails unless the
    /// transaction runs on this session's own server process (see
    /// `Connection::own_backend`); empty behind a pooler configured as one.
    pub fn own_backend_check(&self) -> &str {
        &self.connection().own_backend
    }

    /// The `SET LOCAL`s every transaction opens with (behind a transaction pooler, separated
    /// by `; `, none trailing), or nothing.
    pub fn transaction_settings(&self) -> &str {
        match &self.shared.setup {
            Setup::PerConnection(_) => "",
            Setup::PerTransaction(settings) => settings,
        }
    }

    /// The parameter types the server infers for `sql` now. Nothing is kept: the statement
    /// is closed at once, inside a transaction of its own behind a transaction pooler.
    pub async fn parameter_types(&mut self, sql: &str) -> Result<Vec<Type>, SessionError> {
        if self.names_statements() {
            let statement = self.client().prepare(sql).await?;
            return Ok(statement.params().to_vec());
        }
        self.in_transaction = true;
        self.client().batch_execute("BEGIN").await?;
        // The statement is dropped here, so its `Close` leaves before `ROLLBACK`.
        let types = self
            .client()
            .prepare(sql)
            .await
            .map(|statement| statement.params().to_vec());
        self.rollback().await?;
        Ok(types?)
    }

    /// `sql` prepared on this session: from its cache, or prepared now (one round trip).
    pub async fn prepared(&mut self, sql: &str) -> Result<Statement, SessionError> {
        let connection = self
            .connection
            .as_mut()
            .expect("a session holds its connection until dropped");
        if let Some(statement) = connection.prepared.get(sql) {
            return Ok(statement.clone());
        }
        let statement = connection.client.prepare(sql).await?;
        connection
            .prepared
            .insert(sql.to_string(), statement.clone());
        Ok(statement)
    }

    /// Whether `sql` is in this session's cache of prepared statements.
    pub fn has_prepared(&self, sql: &str) -> bool {
        self.connection().prepared.contains_key(sql)
    }

    /// `sql` prepared on this session anew, replacing what its cache held: the server's
    /// parameter types now, after a migration changed them.
    pub async fn prepare_again(&mut self, sql: &str) -> Result<Statement, SessionError> {
        if let Some(connection) = self.connection.as_mut() {
            connection.prepared.remove(sql);
        }
        self.prepared(sql).await
    }

    /// Marks whether a transaction may be open: a session dropped while one may be is closed.
    pub fn set_in_transaction(&mut self, open: bool) {
        self.in_transaction = open;
    }

    /// Ends the open transaction without keeping anything; until it succeeds, the session
    /// counts as inside one (and is closed when dropped).
    pub async fn rollback(&mut self) -> Result<(), SessionError> {
        self.client().batch_execute("ROLLBACK").await?;
        self.in_transaction = false;
        Ok(())
    }

    /// Closes the connection at once (past a deadline, after an outdated plan): the server
    /// rolls back whatever it held, and the pool opens a new one when needed.
    pub fn detach(mut self) {
        if let Some(connection) = self.connection.take() {
            connection.driver.abort();
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let Some(connection) = self.connection.take() else {
            return;
        };
        if self.in_transaction || connection.client.is_closed() {
            connection.driver.abort();
            return;
        }
        self.shared
            .idle
            .lock()
            .expect("idle sessions")
            .push(connection);
    }
}
