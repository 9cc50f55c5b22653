//! The Postgres pool: connect with backoff, migrate, check the host's tables exist.

use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::MigrateError;
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
use crate::store::tables::Tables;
use crate::tls::Verify;

mod migrate;
mod schema;
mod script;
#[cfg(test)]
mod upgrades;

pub use migrate::{Elsewhere, MIGRATOR, MigrateFailure, Migration, migrate, migrate_tables};
pub use schema::check_schema;
pub use script::{applied_versions, script};

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
    /// idem's tables, with their claims, are in another schema than the configuration's.
    #[error(
        "idem's tables, with rows, are in schema {found} at {endpoint}, not in {place} where this configuration looks; creating empty ones there would forget every claim. Set `schema = {first:?}` in the configuration's database table (for an installation of its own beside theirs, run `idem migrate --new-installation`)"
    )]
    Elsewhere {
        endpoint: String,
        place: String,
        found: String,
        first: String,
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
