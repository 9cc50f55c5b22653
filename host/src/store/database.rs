//! The Postgres pool: connect with backoff, migrate, check the host's tables exist.

use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, PgPool};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::backoff::Backoff;
use crate::config::{Config, DatabaseConfig, DatabaseTls, SYSTEM_ROOTS, SslMode, redact_url};
use crate::store::bookkeeping;
use crate::store::fault::{
    DatabaseFailure, TLS_SETTINGS, refused_setting, session_refused_setting,
};
use crate::store::primary::{self, Candidates};
use crate::store::session::{SessionError, SessionPool, Setup};
use crate::store::tables::{Tables, quote_identifier};
use crate::tls::Verify;

/// The host's own tables (`processed_messages`), embedded at build time.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

#[derive(Debug, thiserror::Error)]
pub enum DatabaseError {
    #[error("cannot reach PostgreSQL at {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: sqlx::Error,
    },
    /// A connection failure no retry can fix: the operator must change `setting`.
    #[error("PostgreSQL at {endpoint} refused the connection: {reason}; check {setting}")]
    Refused {
        endpoint: String,
        reason: String,
        setting: &'static str,
    },
    #[error("cannot open a PostgreSQL session at {endpoint}: {source}")]
    Sessions {
        endpoint: String,
        source: SessionError,
    },
    #[error("migrating {endpoint} failed: {source}")]
    Migrate {
        endpoint: String,
        source: MigrateError,
    },
    #[error("cannot record the consumers' retention windows at {endpoint}: {source}")]
    Consumers {
        endpoint: String,
        source: sqlx::Error,
    },
    /// A `processed_messages` that is not idem's (another consumer's, by the guide's name).
    #[error(
        "the processed_messages table in {place} at {endpoint} is not the claims table idem needs: {problems}; rename that table, or give idem a schema of its own ([database] schema = \"idem\")"
    )]
    ForeignClaims {
        endpoint: String,
        place: String,
        problems: String,
    },
    #[error(
        "idem's tables are missing or out of date in {place} at {endpoint} ({source}); run `idem migrate --config <file>` first"
    )]
    Schema {
        endpoint: String,
        place: String,
        source: sqlx::Error,
    },
}

/// The host's two ways into its database, opened from one `[database]` table: the sessions
/// the message transactions run on (`session`: tokio-postgres, pipelined), and sqlx's pool
/// for everything else (migrations, statement checks, the outbox relay, retention, status).
#[derive(Debug, Clone)]
pub struct Database {
    pub pool: PgPool,
    pub sessions: SessionPool,
    /// Where idem's own tables are (`[database] schema`).
    pub tables: Arc<Tables>,
}

/// Every database of a config, opened: `[database]` first (named `None`), then each
/// `[databases.<name>]` in name order. A pipeline's transactions run in the one it names.
#[derive(Debug, Clone)]
pub struct Databases {
    opened: Vec<(Option<String>, Database)>,
}

impl Databases {
    /// Opens every database of `config`, each as `connect` does (retrying with backoff while
    /// it is unreachable). `Ok(None)` if `shutdown` fires first.
    pub async fn connect(
        config: &Config,
        shutdown: &CancellationToken,
    ) -> Result<Option<Databases>, DatabaseError> {
        let mut opened = Vec::new();
        for (name, database_config) in config.all_databases() {
            let Some(database) = connect(database_config, shutdown).await? else {
                return Ok(None);
            };
            opened.push((name.map(str::to_string), database));
        }
        Ok(Some(Databases { opened }))
    }

    /// Each database with its name (`None`: `[database]`).
    pub fn iter(&self) -> impl Iterator<Item = (Option<&str>, &Database)> {
        self.opened
            .iter()
            .map(|(name, database)| (name.as_deref(), database))
    }

    /// The database called `name` (`None`: `[database]`); the config checked that it exists.
    pub fn named(&self, name: Option<&str>) -> &Database {
        self.iter()
            .find(|(opened, _)| *opened == name)
            .map(|(_, database)| database)
            .expect("the config names only databases it has")
    }

    /// Closes every pool and idle session.
    pub async fn close(&self) {
        for (_, database) in self.iter() {
            database.sessions.close_idle();
            database.pool.close().await;
        }
    }
}

/// How messages name a database of the config: `[database]` or `[databases.<name>]`.
pub fn label(name: Option<&str>) -> String {
    match name {
        Some(name) => format!("[databases.{name}]"),
        None => "[database]".to_string(),
    }
}

/// Connections the bookkeeping pool may hold beside the sessions: the outbox relay,
/// retention, partition upkeep and the admin endpoints share them.
const BOOKKEEPING_CONNECTIONS: u32 = 4;

/// Resolves `[database] url` once, with `[database.tls]` and libpq's environment variables
/// (`PGPASSWORD`, `PGSSLMODE` …, and `~/.pgpass`), by sqlx's parser, host by host; the
/// sessions read the same resolution back, so both kinds of connection agree.
fn resolve(config: &DatabaseConfig) -> Result<Candidates, DatabaseError> {
    let hosts = config.hosts().map_err(|reason| DatabaseError::Refused {
        endpoint: redact_url(&config.url),
        reason,
        setting: "[database] url",
    })?;
    let options = hosts
        .urls
        .iter()
        .map(|url| resolve_host(config, url))
        .collect::<Result<_, _>>()?;
    Ok(Candidates {
        hosts: options,
        read_write: hosts.read_write,
    })
}

fn resolve_host(config: &DatabaseConfig, url: &str) -> Result<PgConnectOptions, DatabaseError> {
    let mut options: PgConnectOptions = url
        .parse()
        .map_err(|source| connect_error(config, source))?;
    if let Some(tls) = &config.tls {
        options = with_tls(options, tls);
    }
    options = as_libpq(options).map_err(|reason| DatabaseError::Refused {
        endpoint: redact_url(&config.url),
        reason,
        setting: "sslmode and sslrootcert in [database] url (or [database.tls] mode and root_cert)",
    })?;
    if options.get_application_name().is_none() {
        // Visible in pg_stat_activity, so an operator can tell idem's sessions apart.
        options = options.application_name("idem");
    }
    // Only startup parameters a connection pooler passes on: sqlx's `extra_float_digits` is
    // not one (PgBouncer refuses it), and idem decodes floats in binary anyway.
    Ok(options.extra_float_digits(None))
}

fn connect_error(config: &DatabaseConfig, source: sqlx::Error) -> DatabaseError {
    match refused_setting(&source) {
        Some(setting) => refused(config, setting, &source),
        None => DatabaseError::Connect {
            endpoint: redact_url(&config.url),
            source,
        },
    }
}

/// A refusal no retry can fix, naming the setting to change.
fn refused(
    config: &DatabaseConfig,
    setting: &'static str,
    error: &impl DatabaseFailure,
) -> DatabaseError {
    DatabaseError::Refused {
        endpoint: redact_url(&config.url),
        reason: crate::store::fault::describe(error),
        setting,
    }
}

/// Builds the bookkeeping pool, trying once (the commands that need no sessions).
pub async fn connect_once(config: &DatabaseConfig) -> Result<PgPool, DatabaseError> {
    pool(config, &resolve(config)?, config.max_connections.get()).await
}

/// The bookkeeping pool, on the first host that answers (and takes writes, when only such a
/// host will do; see `primary`).
async fn pool(
    config: &DatabaseConfig,
    candidates: &Candidates,
    max_connections: u32,
) -> Result<PgPool, DatabaseError> {
    let options = primary::find(candidates)
        .await
        .map_err(|source| connect_error(config, source))?;
    let settings = match setup(config) {
        Setup::PerConnection(settings) => Some(settings),
        Setup::PerTransaction(_) => None,
    };
    let read_write = candidates.read_write;
    let mut pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .after_connect(move |connection, _| {
            let settings = settings.clone();
            Box::pin(async move {
                if let Some(settings) = settings {
                    bookkeeping::raw(&settings)
                        .execute(&mut *connection)
                        .await?;
                }
                if read_write {
                    primary::guard_connect(connection).await?;
                }
                Ok(())
            })
        });
    if read_write {
        pool = pool.before_acquire(|connection, _| Box::pin(primary::guard_reuse(connection)));
    }
    pool.connect_with(options)
        .await
        .map_err(|source| connect_error(config, source))
}

/// Opens the bookkeeping pool and the sessions, trying once; one session is opened now, so
/// a refusal is known at start. `[database] max_connections` bounds the sessions.
pub async fn open(config: &DatabaseConfig) -> Result<Database, DatabaseError> {
    let candidates = resolve(config)?;
    let max_sessions = config.max_connections.get();
    let pool = pool(
        config,
        &candidates,
        max_sessions.min(BOOKKEEPING_CONNECTIONS),
    )
    .await?;
    let tables = Arc::new(Tables::of(config));
    let sessions = sessions(config, &candidates, Arc::clone(&tables), max_sessions)?;
    sessions
        .acquire()
        .await
        .map_err(|source| match session_refused_setting(&source) {
            Some(setting) => refused(config, setting, &source),
            None => DatabaseError::Sessions {
                endpoint: redact_url(&config.url),
                source,
            },
        })?;
    if candidates.hosts.len() > 1 {
        primary::watch(pool.clone(), candidates);
    }
    Ok(Database {
        pool,
        sessions,
        tables,
    })
}

/// The sessions' connection settings, read back from sqlx's resolution of each host: every
/// host in the URL's order, passing over one that takes no writes when only such a host
/// will do (tokio-postgres tries them on each new connection).
fn sessions(
    config: &DatabaseConfig,
    candidates: &Candidates,
    tables: Arc<Tables>,
    max_sessions: u32,
) -> Result<SessionPool, DatabaseError> {
    let options = &candidates.hosts[0];
    let url = options.to_url_lossy();
    let parameter = |name: &str| {
        url.query_pairs()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.into_owned())
    };
    let mut session = session_hosts(candidates);
    session
        .user(options.get_username())
        .application_name(options.get_application_name().unwrap_or("idem"))
        .connect_timeout(Duration::from_secs(5))
        .keepalives(true)
        .keepalives_idle(config.keepalive.max(Duration::from_secs(1)))
        .keepalives_interval(config.keepalive.max(Duration::from_secs(3)) / 3)
        .keepalives_retries(3)
        .tcp_user_timeout(config.keepalive.max(Duration::from_secs(1)) * 2);
    if let Some(database) = options.get_database() {
        session.dbname(database);
    }
    if let Some(password) = url.password() {
        session.password(percent_encoding::percent_decode_str(password).collect::<Vec<u8>>());
    }
    if let Some(settings) = options.get_options() {
        session.options(settings);
    }
    // A certificate given inline (PEM in PGSSLROOTCERT) is not a file; only files are read.
    let file = |name: &str| {
        parameter(name).and_then(|value| value.strip_prefix("file: ").map(std::path::PathBuf::from))
    };
    use tokio_postgres::config::SslMode as Wire;
    let (wire, verify) = match options.get_ssl_mode() {
        PgSslMode::Disable | PgSslMode::Allow => {
            session.ssl_mode(Wire::Disable);
            return Ok(SessionPool::new(
                session,
                tables,
                setup(config),
                None,
                max_sessions,
            ));
        }
        PgSslMode::Prefer => (Wire::Prefer, Verify::Nothing),
        PgSslMode::Require => (Wire::Require, Verify::Nothing),
        PgSslMode::VerifyCa => (Wire::Require, Verify::Authority),
        PgSslMode::VerifyFull => (Wire::Require, Verify::Full),
    };
    session.ssl_mode(wire);
    let root_cert = file("sslrootcert");
    let client_cert = file("sslcert").zip(file("sslkey"));
    let tls = crate::tls::client_config(
        verify,
        root_cert.as_deref(),
        client_cert
            .as_ref()
            .map(|(cert, key)| (cert.as_path(), key.as_path())),
        &crate::tls::POSTGRES_FILES,
    )
    .map_err(|error| DatabaseError::Refused {
        endpoint: redact_url(&config.url),
        reason: error.to_string(),
        setting: TLS_SETTINGS,
    })?;
    Ok(SessionPool::new(
        session,
        tables,
        setup(config),
        Some(MakeRustlsConnect::new(tls)),
        max_sessions,
    ))
}

/// A sessions' configuration with every host in the URL's order, passing over one that takes
/// no writes when only such a host will do.
fn session_hosts(candidates: &Candidates) -> tokio_postgres::Config {
    let mut session = tokio_postgres::Config::new();
    for host in &candidates.hosts {
        match host.get_socket() {
            Some(directory) => session.host_path(directory),
            None => session.host(host.get_host()),
        };
        session.port(host.get_port());
    }
    if candidates.read_write {
        session.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
    }
    session
}

/// libpq's rules for `sslrootcert`: `system` is the system's store (which idem trusts
/// anyway) and no file, and asks for `verify-full` (the default `prefer` becomes it, a weaker
/// mode is refused); a root certificate file turns `require` into `verify-ca`.
fn as_libpq(mut options: PgConnectOptions) -> Result<PgConnectOptions, String> {
    let root_cert = options
        .to_url_lossy()
        .query_pairs()
        .find(|(key, _)| key == "sslrootcert")
        .map(|(_, value)| value.into_owned());
    let Some(root_cert) = root_cert.filter(|value| !value.is_empty()) else {
        return Ok(options);
    };
    let mode = options.get_ssl_mode();
    if root_cert == format!("file: {SYSTEM_ROOTS}") {
        return match mode {
            PgSslMode::Prefer | PgSslMode::VerifyFull => Ok(options
                .ssl_mode(PgSslMode::VerifyFull)
                .ssl_root_cert_from_pem(Vec::new())),
            weaker => Err(format!(
                "sslrootcert=system needs sslmode=verify-full (as libpq), not {weaker:?}"
            )),
        };
    }
    if matches!(mode, PgSslMode::Require) {
        options = options.ssl_mode(PgSslMode::VerifyCa);
    }
    Ok(options)
}

/// The `[database.tls]` settings over the URL's.
fn with_tls(mut options: PgConnectOptions, tls: &DatabaseTls) -> PgConnectOptions {
    if let Some(mode) = tls.mode {
        options = options.ssl_mode(match mode {
            SslMode::Disable => PgSslMode::Disable,
            SslMode::Allow => PgSslMode::Allow,
            SslMode::Prefer => PgSslMode::Prefer,
            SslMode::Require => PgSslMode::Require,
            SslMode::VerifyCa => PgSslMode::VerifyCa,
            SslMode::VerifyFull => PgSslMode::VerifyFull,
        });
    }
    if let Some(root_cert) = &tls.root_cert {
        options = options.ssl_root_cert(root_cert);
    }
    if let Some(cert) = &tls.cert {
        options = options.ssl_client_cert(cert);
    }
    if let Some(key) = &tls.key {
        options = options.ssl_client_key(key);
    }
    options
}

/// How the pool's sessions talk to the server: `TLSv1.3 TLS_AES_256_GCM_SHA384`, or
/// `not encrypted`.
pub async fn encryption(pool: &PgPool) -> Result<String, sqlx::Error> {
    let row: Option<(bool, Option<String>, Option<String>)> =
        bookkeeping::in_transaction(pool, async |connection| {
            bookkeeping::query_as(
                "SELECT ssl, version, cipher FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            )
            .fetch_optional(connection)
            .await
        })
        .await?;
    Ok(match row {
        Some((true, version, cipher)) => format!(
            "{} {}",
            version.unwrap_or_default(),
            cipher.unwrap_or_default()
        ),
        _ => "not encrypted".to_string(),
    })
}

/// The server settings of idem's connections, and where they are set. The server ends a
/// session left idle inside a transaction (so a vanished host's claim locks are released)
/// and probes a silent client with TCP keepalives, so a half-open connection does not live
/// on. Never as startup parameters (`options`), which poolers refuse: as `SET`s once a
/// connection opens, or, behind a transaction pooler, where a session's `SET` would land on
/// some other client's server connection, as a `SET LOCAL` opening each message
/// transaction (the server's keepalives would probe the pooler, which has its own).
/// The sessions add their guard (`session::GUARD`) after these.
fn setup(config: &DatabaseConfig) -> Setup {
    let idle = config.idle_in_transaction_timeout.as_millis();
    if config.pooling.per_transaction() {
        return Setup::PerTransaction(format!(
            "SET LOCAL idle_in_transaction_session_timeout = {idle}"
        ));
    }
    let keepalive = config.keepalive.as_secs().max(1);
    Setup::PerConnection(format!(
        "SET idle_in_transaction_session_timeout = {idle}; \
         SET tcp_keepalives_idle = {keepalive}; \
         SET tcp_keepalives_interval = {}; \
         SET tcp_keepalives_count = 3; \
         SET tcp_user_timeout = {}",
        keepalive.div_ceil(3),
        // Unacknowledged data to a vanished client is given up after twice the keepalive.
        keepalive * 2000,
    ))
}

/// Opens the pool and the sessions, retrying with backoff while PostgreSQL is unreachable. Returns
/// `Ok(None)` if `shutdown` fires first, and an error for a refusal no retry can fix (bad
/// credentials, unknown database, TLS as configured impossible).
pub async fn connect(
    config: &DatabaseConfig,
    shutdown: &CancellationToken,
) -> Result<Option<Database>, DatabaseError> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        match open(config).await {
            Ok(database) => {
                let encryption = encryption(&database.pool)
                    .await
                    .unwrap_or_else(|error| format!("unknown ({error})"));
                info!(endpoint = %redact_url(&config.url), %encryption, "Connected to PostgreSQL.");
                return Ok(Some(database));
            }
            Err(refused @ DatabaseError::Refused { .. }) => return Err(refused),
            Err(error) => {
                let delay = backoff.next_delay();
                warn!(%error, retry_in_ms = delay.as_millis() as u64, "PostgreSQL unavailable; retrying.");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = shutdown.cancelled() => return Ok(None),
                }
            }
        }
    }
}

/// What `migrate` did besides applying migrations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Migration {
    /// idem's tables were moved from this schema into `[database] schema`.
    pub moved_from: Option<String>,
    /// idem's rows were taken out of sqlx's `_sqlx_migrations` (where versions of idem
    /// before its own history wrote them), leaving the application's.
    pub history_adopted: u64,
    /// Migrations applied now.
    pub applied: usize,
}

/// Applies the host's migrations.
///
/// In one transaction, under a transaction-scoped advisory lock, so two hosts migrating at
/// once take turns, and nothing outlives the transaction (safe behind a transaction
/// pooler, where sqlx's migrator, holding a session lock and named statements, is not). The
/// history is idem's own (`idem_migrations`, beside its tables), never an application's:
/// idem's rows in `_sqlx_migrations`, from versions before it, are moved there.
///
/// With `[database] schema`, the schema is created, and idem's tables found in the search
/// path's first schema (an installation from before the setting) are moved into it with
/// their rows, so no claim is forgotten.
///
/// A `processed_messages` of another shape is not adopted: the transaction rolls back and
/// nothing is changed.
pub async fn migrate(pool: &PgPool, config: &DatabaseConfig) -> Result<Migration, DatabaseError> {
    let tables = Tables::of(config);
    let (migration, problems) =
        migrate_tables(pool, &tables)
            .await
            .map_err(|source| DatabaseError::Migrate {
                endpoint: redact_url(&config.url),
                source,
            })?;
    foreign_claims(config, &tables, problems)?;
    if let Some(from) = &migration.moved_from {
        info!(from = %from, to = %tables.place(), "Moved idem's tables.");
    }
    if migration.history_adopted > 0 {
        info!(
            rows = migration.history_adopted,
            "Moved idem's migration history out of _sqlx_migrations into idem_migrations."
        );
    }
    Ok(migration)
}

/// `DatabaseError::ForeignClaims` when the claims table has `problems`.
fn foreign_claims(
    config: &DatabaseConfig,
    tables: &Tables,
    problems: Vec<String>,
) -> Result<(), DatabaseError> {
    if problems.is_empty() {
        return Ok(());
    }
    Err(DatabaseError::ForeignClaims {
        endpoint: redact_url(&config.url),
        place: tables.place(),
        problems: problems.join("; "),
    })
}

/// The advisory lock key migrations take (`idem-migrate`).
const MIGRATION_LOCK: i64 = 0x1de3_0000_0000_0002;

/// idem's migration history: sqlx's columns, so the rows read the same as before.
const CREATE_HISTORY: &str = "CREATE TABLE IF NOT EXISTS {history} (\
       version bigint PRIMARY KEY, description text NOT NULL, \
       installed_on timestamptz NOT NULL DEFAULT now(), success boolean NOT NULL, \
       checksum bytea NOT NULL, execution_time bigint NOT NULL)";

/// Applies what is missing, then checks the claims table; commits only if it is idem's, and
/// returns its problems otherwise.
pub async fn migrate_tables(
    pool: &PgPool,
    tables: &Tables,
) -> Result<(Migration, Vec<String>), MigrateError> {
    let mut transaction = bookkeeping::begin(pool, "").await?;
    bookkeeping::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *transaction)
        .await?;
    let mut migration = Migration::default();
    if let Some(schema) = tables.schema() {
        bookkeeping::raw(&format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            quote_identifier(schema)
        ))
        .execute(&mut *transaction)
        .await?;
        migration.moved_from = move_tables(&mut transaction, tables, schema).await?;
    }
    migration.history_adopted = adopt_history(&mut transaction, tables).await?;
    let applied: Vec<(i64, Vec<u8>, bool)> =
        bookkeeping::query_as(&tables.sql("SELECT version, checksum, success FROM {history}"))
            .fetch_all(&mut *transaction)
            .await?;
    if let Some(schema) = tables.schema() {
        // The migrations name their tables unqualified: they land in idem's schema.
        bookkeeping::raw(&format!(
            "SET LOCAL search_path TO {}",
            quote_identifier(schema)
        ))
        .execute(&mut *transaction)
        .await?;
    }
    for step in MIGRATOR.iter() {
        if step.migration_type.is_down_migration() {
            continue;
        }
        match applied
            .iter()
            .find(|(version, ..)| *version == step.version)
        {
            Some((version, _, false)) => return Err(MigrateError::Dirty(*version)),
            Some((version, checksum, true)) if *checksum != *step.checksum => {
                return Err(MigrateError::VersionMismatch(*version));
            }
            Some(_) => continue,
            None => {}
        }
        let started = std::time::Instant::now();
        sqlx::raw_sql(step.sql.clone())
            .execute(&mut *transaction)
            .await?;
        bookkeeping::query(&tables.sql(
            "INSERT INTO {history} (version, description, success, checksum, execution_time) \
             VALUES ($1, $2, true, $3, $4)",
        ))
        .bind(step.version)
        .bind(&*step.description)
        .bind(&*step.checksum)
        .bind(i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX))
        .execute(&mut *transaction)
        .await?;
        migration.applied += 1;
    }
    let problems = claims_table_problems(&mut transaction, tables).await?;
    if problems.is_empty() {
        transaction.commit().await?;
    } else {
        transaction.rollback().await?;
    }
    Ok((migration, problems))
}

/// idem's tables of an installation from before `[database] schema`, in the search path's
/// first schema: moved into `schema` (with their indexes, sequences and rows, and the
/// claims' day partitions) when it has no claims table yet. Returns the schema they came
/// from.
async fn move_tables(
    transaction: &mut sqlx::PgConnection,
    tables: &Tables,
    schema: &str,
) -> Result<Option<String>, sqlx::Error> {
    let home: Option<String> = bookkeeping::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut *transaction)
        .await?;
    let Some(home) = home.filter(|home| home != schema) else {
        return Ok(None);
    };
    let there = Tables::new(Some(&home));
    let found: (bool, bool) = bookkeeping::query_as(&format!(
        "SELECT to_regclass({}) IS NULL AND to_regclass({}) IS NOT NULL, \
                to_regclass({}) IS NOT NULL OR to_regclass({}) IS NOT NULL",
        literal(tables.claims()),
        literal(there.claims()),
        literal(there.history()),
        literal(there.consumers()),
    ))
    .fetch_one(&mut *transaction)
    .await?;
    // idem's own: its history or its consumers' table beside the claims.
    if found != (true, true) {
        return Ok(None);
    }
    let partitions: Vec<String> = bookkeeping::query_scalar(&format!(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass({})",
        literal(there.claims())
    ))
    .fetch_all(&mut *transaction)
    .await?;
    let mut moved: Vec<String> = [
        there.claims(),
        there.outbox(),
        there.consumers(),
        there.archive(),
        there.history(),
    ]
    .map(str::to_string)
    .to_vec();
    moved.extend(
        partitions
            .iter()
            .map(|partition| there.qualified(partition)),
    );
    for table in moved {
        if table_exists(transaction, &table).await? {
            bookkeeping::raw(&format!(
                "ALTER TABLE {table} SET SCHEMA {}",
                quote_identifier(schema)
            ))
            .execute(&mut *transaction)
            .await?;
        }
    }
    Ok(Some(home))
}

/// Creates idem's history, and moves idem's rows (its versions, with their checksums) out
/// of the `_sqlx_migrations` the search path finds, where idem wrote them before it had a
/// history of its own: into idem's history when idem's tables are where it is, so those
/// migrations are not run again. Returns the rows taken out.
async fn adopt_history(
    transaction: &mut sqlx::PgConnection,
    tables: &Tables,
) -> Result<u64, sqlx::Error> {
    bookkeeping::raw(&tables.sql(CREATE_HISTORY))
        .execute(&mut *transaction)
        .await?;
    if !table_exists(transaction, "_sqlx_migrations").await? {
        return Ok(0);
    }
    let (versions, checksums): (Vec<i64>, Vec<Vec<u8>>) = MIGRATOR
        .iter()
        .filter(|step| !step.migration_type.is_down_migration())
        .map(|step| (step.version, step.checksum.to_vec()))
        .unzip();
    let in_place = table_exists(transaction, tables.claims()).await?;
    let taken: i64 = bookkeeping::query_scalar(&tables.sql(
        "WITH idem AS (DELETE FROM _sqlx_migrations \
           WHERE (version, checksum) IN (SELECT * FROM unnest($1::int8[], $2::bytea[])) \
           RETURNING *), \
         kept AS (INSERT INTO {history} \
             (version, description, installed_on, success, checksum, execution_time) \
           SELECT version, description, installed_on, success, checksum, execution_time \
           FROM idem WHERE $3 \
           ON CONFLICT (version) DO NOTHING) \
         SELECT count(*) FROM idem",
    ))
    .bind(&versions)
    .bind(&checksums)
    .bind(in_place)
    .fetch_one(&mut *transaction)
    .await?;
    Ok(u64::try_from(taken).unwrap_or_default())
}

/// Whether `table` (qualified, or found by the search path) exists.
async fn table_exists(
    transaction: &mut sqlx::PgConnection,
    table: &str,
) -> Result<bool, sqlx::Error> {
    bookkeeping::query_scalar(&format!(
        "SELECT to_regclass({}) IS NOT NULL",
        literal(table)
    ))
    .fetch_one(transaction)
    .await
}

/// `text` as a SQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The columns the claims need, with their types as `format_type` writes them.
const CLAIM_COLUMNS: [(&str, &str); 4] = [
    ("consumer", "text"),
    ("message_key", "text"),
    ("processed_at", "timestamp with time zone"),
    ("plugin_digest", "text"),
];

/// How the `processed_messages` that idem's statements reach (by the search path) differs
/// from the claims table idem needs: a column missing or of another type, a column the
/// claims would leave empty that may not be, no unique key on `(consumer, message_key)`
/// (`processed_at` added on a partitioned one). Empty when it is idem's, or absent.
async fn claims_table_problems(
    connection: &mut sqlx::PgConnection,
    tables: &Tables,
) -> Result<Vec<String>, sqlx::Error> {
    let claims = literal(tables.claims());
    // No parameters: the simple protocol, one exchange (see `bookkeeping`).
    let columns = bookkeeping::raw(&format!(
        "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), \
                (a.attnotnull AND NOT a.atthasdef AND a.attidentity = '')::text \
         FROM pg_attribute a \
         WHERE a.attrelid = to_regclass({claims}) AND a.attnum > 0 \
           AND NOT a.attisdropped"
    ))
    .fetch_all(&mut *connection)
    .await?;
    if columns.is_empty() {
        return Ok(Vec::new());
    }
    let column = |row: &sqlx::postgres::PgRow, index: usize| -> Result<String, sqlx::Error> {
        sqlx::Row::try_get::<String, _>(row, index)
    };
    let mut found = Vec::with_capacity(columns.len());
    for row in &columns {
        found.push((column(row, 0)?, column(row, 1)?, column(row, 2)? == "true"));
    }
    let mut problems = Vec::new();
    for (name, wanted) in CLAIM_COLUMNS {
        match found.iter().find(|(column, ..)| column == name) {
            None => problems.push(format!("no column {name} ({wanted})")),
            Some((_, kind, _)) if kind != wanted => {
                problems.push(format!("column {name} is {kind}, idem needs {wanted}"));
            }
            Some(_) => {}
        }
    }
    for (name, _, required) in &found {
        if *required && !CLAIM_COLUMNS.iter().any(|(column, _)| column == name) {
            problems.push(format!(
                "column {name} is NOT NULL without a default (idem's claims do not fill it)"
            ));
        }
    }
    let keys = bookkeeping::raw(&format!(
        "SELECT string_agg(a.attname::text, ',' ORDER BY a.attname) \
         FROM pg_index i JOIN pg_attribute a \
           ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) \
         WHERE i.indrelid = to_regclass({claims}) AND i.indisunique \
         GROUP BY i.indexrelid"
    ))
    .fetch_all(&mut *connection)
    .await?;
    let mut unique = Vec::with_capacity(keys.len());
    for row in &keys {
        unique.push(column(row, 0)?);
    }
    let claim_key = ["consumer,message_key", "consumer,message_key,processed_at"];
    if !unique.iter().any(|key| claim_key.contains(&key.as_str())) {
        problems.push(format!(
            "no unique key on (consumer, message_key) (unique keys: {})",
            if unique.is_empty() {
                "none".to_string()
            } else {
                unique
                    .iter()
                    .map(|key| format!("({})", key.replace(',', ", ")))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
    }
    Ok(problems)
}

/// Fails unless the host's tables (claims, and the outbox when `outbox` is configured) exist
/// and are usable: a missing table must stop start-up, not dead-letter every message.
pub async fn check_schema(
    pool: &PgPool,
    config: &DatabaseConfig,
    outbox: bool,
) -> Result<(), DatabaseError> {
    let tables = Tables::of(config);
    let mut probes = vec![
        "SELECT consumer, message_key, processed_at, plugin_digest FROM {claims} LIMIT 0",
        "SELECT consumer, retention_window, recorded_at, paused_at, pause_reason \
         FROM {consumers} LIMIT 0",
    ];
    if outbox {
        probes.push(
            "SELECT id, destination, idempotency_key, payload, headers, attempts, next_attempt_at, \
             last_error, delivered_at, parked_at FROM {outbox} LIMIT 0",
        );
    }
    let schema_error = |source| DatabaseError::Schema {
        endpoint: redact_url(&config.url),
        place: tables.place(),
        source,
    };
    // Another consumer's table first: `idem migrate` would not adopt it either.
    let mut connection = pool.acquire().await.map_err(schema_error)?;
    let problems = claims_table_problems(&mut connection, &tables)
        .await
        .map_err(schema_error)?;
    foreign_claims(config, &tables, problems)?;
    for probe in probes {
        // No parameters: the simple protocol, one exchange (see `bookkeeping`).
        bookkeeping::raw(&tables.sql(probe))
            .execute(&mut *connection)
            .await
            .map_err(schema_error)?;
    }
    Ok(())
}
