//! The `[database]` table: the PostgreSQL server that holds the claims, the effects and the
//! outbox.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use toml::Spanned;

use super::ConfigError;
use super::text::{Document, duration, duration_schema, interpolated, interpolated_path_option};

/// The `[database]` table.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// A `postgres://` URL. It may list several hosts, as libpq does
    /// (`postgres://idem@db1:5432,db2:5432/orders`): idem connects to the first that answers
    /// and takes writes (`target_session_attrs=read-write`, the default with several hosts;
    /// `primary` is the same; `any` takes the first that answers), and looks again when it
    /// stops taking them (a failover).
    #[serde(deserialize_with = "interpolated")]
    pub url: String,
    /// Upper bound of the connection pool shared by all pipelines.
    #[serde(default = "default_max_connections")]
    pub max_connections: NonZeroU32,
    /// The server ends a host session left idle inside a transaction this long
    /// (`idle_in_transaction_session_timeout`), releasing its claim locks: a host that died or
    /// lost its connection mid-transaction cannot hold a key. Default 20 s.
    #[serde(default = "default_idle_in_transaction", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub idle_in_transaction_timeout: Duration,
    /// A silent connection is probed after this long (TCP keepalive, then `tcp_user_timeout`
    /// for unacknowledged data), by idem and by the server, so a vanished peer's connection
    /// ends on both sides. Default 30 s.
    #[serde(default = "default_keepalive", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub keepalive: Duration,
    /// TLS settings; each one set here overrides the URL's `sslmode`, `sslrootcert`,
    /// `sslcert` or `sslkey` (which are honoured as libpq does).
    #[serde(default)]
    pub tls: Option<DatabaseTls>,
    /// What sits between idem and PostgreSQL: `"none"` (the default), or a connection pooler
    /// (PgBouncer, RDS Proxy, Supavisor …) by its pool mode, `"session"` or `"transaction"`.
    /// Behind transaction pooling no session state lasts past a transaction, so idem names no
    /// prepared statement and sets its server settings in every transaction.
    #[serde(default)]
    pub pooling: Pooling,
    /// The schema idem keeps its own tables in (the claims `processed_messages`,
    /// `idem_outbox`, `idem_consumers`) with its own migration history
    /// (`idem_migrations`), apart from the application's tables and migrations:
    /// `"idem"`, say. `idem migrate` creates it, and moves idem's tables there from the
    /// search path's first schema if an earlier installation left them there. Without it,
    /// they are in the search path's first schema (`public`, usually), as before. Lower case
    /// letters, digits and `_`.
    #[serde(default)]
    pub schema: Option<String>,
}

/// `[database] pooling`: how a connection pooler in front of PostgreSQL hands out its
/// server connections, as its `pool_mode` says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Pooling {
    /// A connection is PostgreSQL's own session (no pooler, or one of session pooling).
    #[default]
    None,
    /// A pooler that gives each client connection one server connection until it closes:
    /// the same as none for idem.
    Session,
    /// A pooler that gives a client connection a server connection for one transaction at a
    /// time.
    Transaction,
}

impl Pooling {
    /// Whether session state (prepared statements, `SET`, advisory locks) lasts only as
    /// long as a transaction.
    pub fn per_transaction(self) -> bool {
        self == Pooling::Transaction
    }
}

/// The `[database.tls]` table. Relative paths resolve against the config file's directory.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatabaseTls {
    /// As libpq's `sslmode`: disable | allow | prefer (the default) | require | verify-ca |
    /// verify-full.
    pub mode: Option<SslMode>,
    /// PEM file of certificate authorities that may sign the server's certificate
    /// (`sslrootcert`), trusted besides the system's store; `system` (as libpq): the system's
    /// store alone, with `verify-full`.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub root_cert: Option<PathBuf>,
    /// PEM client certificate (`sslcert`), for servers that require one.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub cert: Option<PathBuf>,
    /// PEM private key of the client certificate (`sslkey`).
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub key: Option<PathBuf>,
}

/// libpq's `sslrootcert=system`: the system's store, no file.
pub const SYSTEM_ROOTS: &str = "system";

/// libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl DatabaseConfig {
    /// The table as loaded: its host list checked, its TLS files resolved against the config
    /// file's directory.
    pub(super) fn checked(
        table: Spanned<DatabaseConfig>,
        key: &str,
        document: &Document,
    ) -> Result<DatabaseConfig, ConfigError> {
        let span = Some(table.span());
        let mut database = table.into_inner();
        database
            .hosts()
            .map_err(|problem| document.at(span.clone(), &format!("{key}.url"), problem))?;
        if let Some(problem) = database.schema.as_deref().and_then(schema_problem) {
            return Err(document.at(span, &format!("{key}.schema"), problem));
        }
        if let Some(tls) = &mut database.tls {
            let system = Path::new(SYSTEM_ROOTS);
            let root_cert = tls
                .root_cert
                .as_mut()
                .filter(|path| path.as_path() != system);
            for path in [root_cert, tls.cert.as_mut(), tls.key.as_mut()]
                .into_iter()
                .flatten()
            {
                *path = document.resolve(path);
            }
        }
        Ok(database)
    }

    /// The servers `url` names, each as a URL of its own.
    pub fn hosts(&self) -> Result<Hosts, String> {
        Hosts::of(&self.url)
    }
}

/// What is wrong with `[database] schema` as a schema name idem may create and name
/// unquoted in messages: lower case letters, digits and `_`, not starting with a digit or
/// `pg_` (PostgreSQL's own), at most 63 bytes.
fn schema_problem(schema: &str) -> Option<String> {
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    if schema.is_empty()
        || schema.len() > 63
        || !schema.chars().all(allowed)
        || schema.starts_with(|c: char| c.is_ascii_digit())
    {
        return Some(format!(
            "{schema:?} is not a schema name idem takes: 1 to 63 lower case letters, digits or _, not starting with a digit"
        ));
    }
    if schema.starts_with("pg_") || schema == "information_schema" {
        return Some(format!("{schema:?} is PostgreSQL's own schema"));
    }
    None
}

/// The servers a `[database] url` names: one, or libpq's list of hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts {
    /// One URL per host, in the list's order: the list replaced by that host, without
    /// `target_session_attrs` (which no single connection takes).
    pub urls: Vec<String>,
    /// Only a host that takes writes will do (`SHOW transaction_read_only` is `off`).
    pub read_write: bool,
}

impl Hosts {
    fn of(url: &str) -> Result<Hosts, String> {
        let Some((scheme, rest)) = url.split_once("://") else {
            // libpq's `key=value` form: one host, as sqlx reads it.
            return Ok(Hosts {
                urls: vec![url.to_string()],
                read_write: false,
            });
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (user, list) = match authority.rsplit_once('@') {
            Some((user, list)) => (format!("{user}@"), list),
            None => (String::new(), authority),
        };
        let (tail, attributes) = without_parameter(tail, "target_session_attrs");
        let hosts: Vec<&str> = list.split(',').collect();
        if hosts.len() > 1 && hosts.iter().any(|host| host.is_empty()) {
            return Err(format!(
                "{:?} lists an empty host",
                crate::config::redact_url(url)
            ));
        }
        let read_write = match attributes.as_deref() {
            None => hosts.len() > 1,
            Some("any") => false,
            Some("read-write" | "primary") => true,
            Some(other) => {
                return Err(format!(
                    "target_session_attrs={other}: idem writes, so it takes read-write, primary or any"
                ));
            }
        };
        Ok(Hosts {
            urls: hosts
                .iter()
                .map(|host| format!("{scheme}://{user}{host}{tail}"))
                .collect(),
            read_write,
        })
    }
}

/// `tail` (a URL's path and query) without the query parameter `name`, and its value.
fn without_parameter(tail: &str, name: &str) -> (String, Option<String>) {
    let Some((path, query)) = tail.split_once('?') else {
        return (tail.to_string(), None);
    };
    let mut value = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.split_once('=') {
            Some((key, found)) if key == name => {
                value = Some(found.to_string());
                false
            }
            _ => true,
        })
        .collect();
    if kept.is_empty() {
        (path.to_string(), value)
    } else {
        (format!("{path}?{}", kept.join("&")), value)
    }
}

fn default_max_connections() -> NonZeroU32 {
    NonZeroU32::new(16).expect("non-zero literal")
}

fn default_idle_in_transaction() -> Duration {
    Duration::from_secs(20)
}

fn default_keepalive() -> Duration {
    Duration::from_secs(30)
}
