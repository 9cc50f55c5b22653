//! The `[database]` table: the PostgreSQL server that holds the claims, the effects and the
//! outbox.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use super::text::{Document, duration, duration_schema, interpolated, interpolated_path_option};

/// The `[database]` table.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// A `postgres://` URL.
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
    /// The server probes a silent client connection after this long (TCP keepalive, then
    /// `tcp_user_timeout` for unacknowledged data), so a vanished host's session ends.
    /// Default 30 s.
    #[serde(default = "default_keepalive", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub keepalive: Duration,
    /// TLS settings; each one set here overrides the URL's `sslmode`, `sslrootcert`,
    /// `sslcert` or `sslkey` (which are honoured as libpq does).
    #[serde(default)]
    pub tls: Option<DatabaseTls>,
}

/// The `[database.tls]` table. Relative paths resolve against the config file's directory.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatabaseTls {
    /// As libpq's `sslmode`: disable | allow | prefer (the default) | require | verify-ca |
    /// verify-full.
    pub mode: Option<SslMode>,
    /// PEM file of the certificate authorities that may sign the server's certificate
    /// (`sslrootcert`); without it, the Mozilla roots.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub root_cert: Option<PathBuf>,
    /// PEM client certificate (`sslcert`), for servers that require one.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub cert: Option<PathBuf>,
    /// PEM private key of the client certificate (`sslkey`).
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub key: Option<PathBuf>,
}

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
    /// The table as loaded: its TLS files resolved against the config file's directory.
    pub(super) fn checked(mut self, document: &Document) -> DatabaseConfig {
        if let Some(tls) = &mut self.tls {
            for path in [&mut tls.root_cert, &mut tls.cert, &mut tls.key]
                .into_iter()
                .flatten()
            {
                *path = document.resolve(path);
            }
        }
        self
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
