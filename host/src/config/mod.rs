//! `pipelines.toml`: what to consume, which plugin decides, which SQL it may run.
//!
//! The file is parsed and checked once, in [`Config::load`]: parsed whole (unknown keys are
//! refused), then each table checked by its own file here, which also fills the defaults
//! that depend on other keys. Every error names the file, the line and the key. String values
//! that name endpoints or paths may use `${VAR}` or `${VAR:-default}`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

mod database;
mod http;
mod outbox;
mod pipeline;
mod plugin_pool;
mod retry;
mod schema;
mod source;
mod statements;
mod text;
mod tls;
mod traces;
mod transaction;

pub use database::{DatabaseConfig, DatabaseTls, Hosts, Pooling, SYSTEM_ROOTS, SslMode};
pub use http::HttpConfig;
pub use outbox::{Destination, OutboxConfig};
pub use pipeline::{BatchConfig, ClaimMode, PipelineConfig, PluginLimits, RetentionConfig};
pub use plugin_pool::PluginPoolConfig;
pub use retry::RetryConfig;
pub use schema::json_schema;
pub use source::SourceConfig;
pub use source::jetstream::{ConsumerStart, JetStreamConfig, subject_matches};
pub use source::kafka::{Assignment, KafkaConfig, KafkaStart, Ordering, Sasl, SaslMechanism};
pub use source::rabbitmq::{AmqpConfig, QueueArgument, QueueType, RabbitMqConfig};
pub use text::{parse_duration, redact_url};
pub use tls::ClientTls;
pub use traces::{OtlpProtocol, TracesConfig};
pub use transaction::{Isolation, OnTimeout, TransactionConfig};

use outbox::RawOutbox;
use pipeline::RawPipeline;
use text::Document;

/// A loaded and validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    pub database: DatabaseConfig,
    /// Further databases by name (`[databases.<name>]`), for pipelines whose effects live
    /// elsewhere (`database = "<name>"`).
    pub databases: BTreeMap<String, DatabaseConfig>,
    /// The HTTP endpoint (`/metrics`, `/healthz`, `/readyz`, `/admin/…`); none when absent.
    pub http: Option<HttpConfig>,
    /// Pipelines by name, in name order.
    pub pipelines: Vec<PipelineConfig>,
    /// The `[outbox]` table: destinations and the relay; none when absent.
    pub outbox: Option<OutboxConfig>,
    /// The `[plugin_pool]` table.
    pub plugin_pool: PluginPoolConfig,
    /// The `[traces]` table: OpenTelemetry export; none when absent.
    pub traces: Option<TracesConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path:?}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config {path:?}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The file as written, before defaults that depend on other keys are filled in. Its doc
/// comments are the descriptions `idem schema` gives editors.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(
    title = "pipelines.toml",
    description = "The idem host's configuration: where the database and the broker are, and one [pipelines.<name>] table per consumed queue or stream. Strings may use ${VAR}, ${VAR:-default}, ${file:/path} (a file's content) and $${ (a literal ${)."
)]
struct PipelinesFile {
    /// PostgreSQL: the claims, the effects and the outbox live there.
    #[schemars(with = "DatabaseConfig")]
    database: Spanned<DatabaseConfig>,
    /// Further PostgreSQL databases by name, each with its own claims, outbox and migrations:
    /// a pipeline whose effects live in one says `database = "<name>"` (the claim must be in
    /// the same database as the effects).
    #[serde(default)]
    #[schemars(with = "BTreeMap<String, DatabaseConfig>")]
    databases: BTreeMap<String, Spanned<DatabaseConfig>>,
    /// RabbitMQ: the broker of every pipeline that consumes a RabbitMQ queue and of every
    /// outbox destination that publishes to an exchange, which need it.
    #[schemars(with = "Option<AmqpConfig>")]
    amqp: Option<Spanned<AmqpConfig>>,
    /// The HTTP endpoint (`/metrics`, `/healthz`, `/readyz`, `/admin/…`); off when absent.
    #[schemars(with = "Option<HttpConfig>")]
    http: Option<Spanned<HttpConfig>>,
    /// One table per pipeline: a source, a plugin and the statements it may use.
    #[serde(default)]
    pipelines: BTreeMap<String, RawPipeline>,
    /// The transactional outbox: destinations, and the relay that delivers after commit.
    #[schemars(with = "Option<RawOutbox>")]
    outbox: Option<Spanned<RawOutbox>>,
    /// wasmtime's pooling allocator for plugin instances.
    plugin_pool: Option<PluginPoolConfig>,
    /// OpenTelemetry traces over OTLP (`idem run`); the standard `OTEL_*` variables win.
    #[schemars(with = "Option<TracesConfig>")]
    traces: Option<Spanned<TracesConfig>>,
}

impl Config {
    /// Reads, interpolates and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml(path, &text)
    }

    /// Parses `text` as if read from `path`; relative plugin paths resolve against its directory.
    pub fn from_toml(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let document = Document { path, text };
        let file: PipelinesFile =
            toml::from_str(text).map_err(|error| document.invalid(error.to_string()))?;
        let database = DatabaseConfig::checked(file.database, "database", &document)?;
        let databases = file
            .databases
            .into_iter()
            .map(|(name, table)| {
                let key = format!("databases.{name}");
                DatabaseConfig::checked(table, &key, &document).map(|table| (name, table))
            })
            .collect::<Result<BTreeMap<_, _>, _>>()?;
        let amqp = file
            .amqp
            .map(|table| AmqpConfig::checked(table, &document))
            .transpose()?;
        let http = file
            .http
            .map(|table| HttpConfig::checked(table, &document))
            .transpose()?;
        let outbox = file
            .outbox
            .map(|table| RawOutbox::checked(table, amqp.as_ref(), &document))
            .transpose()?;
        let traces = file
            .traces
            .map(|table| TracesConfig::checked(table, &document))
            .transpose()?;
        let pipelines = file
            .pipelines
            .into_iter()
            .map(|(name, raw)| {
                raw.checked(name, &databases, outbox.as_ref(), amqp.as_ref(), &document)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Config {
            path: path.to_path_buf(),
            database,
            databases,
            http,
            pipelines,
            outbox,
            plugin_pool: file.plugin_pool.unwrap_or_default(),
            traces,
        })
    }

    /// A config `idem run` can serve: one with a pipeline (a database-only config serves
    /// `idem migrate`, `cleanup` and `outbox`).
    pub fn require_pipelines(&self) -> Result<(), ConfigError> {
        if self.pipelines.is_empty() {
            return Err(ConfigError::Invalid {
                path: self.path.clone(),
                message: "no pipelines: idem run needs a [pipelines.<name>] table".into(),
            });
        }
        Ok(())
    }

    /// Every database: `[database]` (named `None`) first, then `[databases.<name>]` in name
    /// order.
    pub fn all_databases(&self) -> impl Iterator<Item = (Option<&str>, &DatabaseConfig)> {
        std::iter::once((None, &self.database)).chain(
            self.databases
                .iter()
                .map(|(name, database)| (Some(name.as_str()), database)),
        )
    }

    /// The database `pipeline`'s claims, effects and outbox rows live in.
    pub fn database_of(&self, pipeline: &PipelineConfig) -> &DatabaseConfig {
        pipeline
            .database
            .as_ref()
            .and_then(|name| self.databases.get(name))
            .unwrap_or(&self.database)
    }

    /// The pipelines whose claims live in database `name` (`None`: `[database]`).
    pub fn pipelines_in(&self, name: Option<&str>) -> Vec<PipelineConfig> {
        self.pipelines
            .iter()
            .filter(|pipeline| pipeline.database.as_deref() == name)
            .cloned()
            .collect()
    }

    /// The pipeline called `name`, if configured.
    pub fn pipeline(&self, name: &str) -> Option<&PipelineConfig> {
        self.pipelines.iter().find(|pipeline| pipeline.name == name)
    }
}

#[cfg(test)]
mod tests;
