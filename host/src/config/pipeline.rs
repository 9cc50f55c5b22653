//! One `[pipelines.<name>]` table: a source, a plugin, the statements it may use, and how its
//! messages are handled (claims, transactions, batches, tries, plugin limits, retention).

use std::collections::BTreeMap;
use std::num::{NonZeroU16, NonZeroU32, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::database::DatabaseConfig;
use super::outbox::OutboxConfig;
use super::retry::RetryConfig;
use super::source::rabbitmq::{AmqpConfig, QueueArgument, QueueType, RabbitMqKeys};
use super::source::{self, RawSource, SourceConfig};
use super::statements;
use super::text::{
    Document, Table, duration, duration_option, duration_schema, interpolated_option,
    interpolated_path, interpolated_spanned_option,
};
use super::transaction::TransactionConfig;

/// One `[pipelines.<name>]` table: a source, a plugin and the statements it may use.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// The table name, used in logs, metrics and the plugin's `message.pipeline`.
    pub name: String,
    /// What the pipeline consumes, and from which kind of broker.
    pub source: SourceConfig,
    /// The consumer name written in claims; several consumers may share one ledger.
    pub consumer: String,
    /// The `[databases.<name>]` its claims and effects live in; `None`: `[database]`.
    pub database: Option<String>,
    /// The plugin component, resolved against the config file's directory.
    pub plugin: PathBuf,
    pub claim: ClaimMode,
    /// With `claim = "natural"`: the statement whose rows affected decide (0 means duplicate).
    pub claim_statement: Option<String>,
    /// Isolation, retries and role of the message's transaction.
    pub transaction: TransactionConfig,
    /// The outbox destinations this pipeline's `outbox` effects may name.
    pub outbox: Option<OutboxConfig>,
    pub prefetch: NonZeroU16,
    pub workers: NonZeroUsize,
    /// How many messages share one transaction.
    pub batch: BatchConfig,
    /// How many times a message is tried when the plugin says its failure is retryable.
    pub max_attempts: NonZeroU32,
    /// How long it waits between those tries.
    pub retry: RetryConfig,
    pub limits: PluginLimits,
    pub retention: RetentionConfig,
    /// A message body file every new plugin build must handle (decision or skip, effects
    /// that fit their statements) before it may serve.
    pub self_test: Option<PathBuf>,
    /// A case file (`idem test`'s format) every new plugin build must pass before it may
    /// serve, and `idem check` runs.
    pub cases: Option<PathBuf>,
    /// Reload the plugin when its file changes.
    pub watch: bool,
    /// Named SQL statements, by name.
    pub statements: BTreeMap<String, String>,
}

/// How a message is recognised as already applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ClaimMode {
    /// A row in `processed_messages` keyed by `(consumer, key)`, inserted in the effects' transaction.
    Ledger,
    /// The effect's own table holds the unique key: the `claim_statement` runs first, and
    /// zero rows affected means the message was already applied; nothing else runs.
    Natural,
    /// The effects are idempotent by construction (e.g. version-guarded upserts): they all
    /// run, and zero rows affected by every one of them means the message is `stale`.
    None,
}

impl ClaimMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimMode::Ledger => "ledger",
            ClaimMode::Natural => "natural",
            ClaimMode::None => "none",
        }
    }
}

/// The `[pipelines.<name>.batch]` table: several messages per transaction, each in its own
/// savepoint, so one commit (one WAL flush) serves them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Messages per transaction at most (default 64); 1 turns batching off.
    #[serde(default = "default_batch_messages")]
    pub size: NonZeroUsize,
    /// How long a worker waits for more messages after the first before it applies a
    /// partial batch (default 0: only what the broker already delivered, so a quiet queue
    /// gets no added latency and a busy one gets full batches).
    #[serde(default, deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub linger: Duration,
    /// How long nearly every message (the 99th percentile) may take from the moment a
    /// worker takes it to its ack: the batch size adapts to the load (from 1 up to `size`)
    /// so batches settle well within it (see `batch_size`). Unset (the default): every
    /// batch takes up to `size`.
    #[serde(default, deserialize_with = "duration_option")]
    #[schemars(schema_with = "duration_schema")]
    pub latency: Option<Duration>,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            size: default_batch_messages(),
            linger: Duration::ZERO,
            latency: None,
        }
    }
}

/// The `[pipelines.<name>.retention]` table: how long claims are kept (the guide's Step 5).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Claims older than this are deleted: the longest redelivery or replay you accept
    /// (`30d` by default). A replay older than the window would apply again.
    #[serde(default = "default_window", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub window: Duration,
    /// Rows deleted per statement; small batches keep locks and WAL bursts short.
    #[serde(default = "default_cleanup_batch")]
    pub batch_size: NonZeroU32,
    /// Pause between batches.
    #[serde(default = "default_pause", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub pause: Duration,
    /// How often `idem run` cleans (`0s` turns the background cleaning off; `idem cleanup` still works).
    #[serde(default = "default_every", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub every: Duration,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            window: default_window(),
            batch_size: default_cleanup_batch(),
            pause: default_pause(),
            every: default_every(),
        }
    }
}

/// What one plugin call may consume before its message is rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginLimits {
    /// Wall-clock budget of one call, instantiation included, in milliseconds.
    #[serde(default = "default_deadline_ms")]
    pub deadline_ms: NonZeroU32,
    /// Linear memory a plugin instance may grow to, in MiB.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: NonZeroU32,
    /// Effects one decision may return.
    #[serde(default = "default_max_effects")]
    pub max_effects: NonZeroUsize,
    /// Messages one plugin instance may serve before it is replaced. 1 (the default): a fresh
    /// instance per message. More trades isolation between messages (globals, caches and
    /// the heap carry over) for the cost of starting an interpreter; an instance is also
    /// replaced after any failure.
    #[serde(default = "default_messages_per_instance")]
    pub messages_per_instance: NonZeroU32,
}

impl PluginLimits {
    pub fn deadline(&self) -> Duration {
        Duration::from_millis(u64::from(self.deadline_ms.get()))
    }

    pub fn memory_bytes(&self) -> usize {
        usize::try_from(self.memory_mib.get())
            .unwrap_or(usize::MAX)
            .saturating_mul(1024 * 1024)
    }
}

impl Default for PluginLimits {
    fn default() -> Self {
        PluginLimits {
            deadline_ms: default_deadline_ms(),
            memory_mib: default_memory_mib(),
            max_effects: default_max_effects(),
            messages_per_instance: default_messages_per_instance(),
        }
    }
}

impl PipelineConfig {
    /// The queue (or stream) consumed, as logs, metrics and plugins name it.
    pub fn queue(&self) -> &str {
        self.source.queue()
    }

    /// Where rejected messages go: the dead-letter queue, or subject.
    pub fn dead_letter(&self) -> &str {
        self.source.dead_letter()
    }

    /// The kind of source, as plugins see it in `message.source`.
    pub fn source_kind(&self) -> &'static str {
        self.source.kind()
    }

    /// The prefetch the consumer asks for: the configured one, raised to twice what the
    /// workers can hold at once (`workers × batch.size`) so none waits for deliveries.
    pub fn effective_prefetch(&self) -> u16 {
        let busy = self
            .workers
            .get()
            .saturating_mul(self.batch.size.get())
            .saturating_mul(2);
        u16::try_from(busy)
            .unwrap_or(u16::MAX)
            .max(self.prefetch.get())
    }
}

/// One `[pipelines.<name>]` table as written.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPipeline {
    /// What the pipeline consumes: `kind = "rabbitmq"` and the queue, or `kind = "jetstream"`
    /// and the stream.
    #[schemars(with = "Option<RawSource>")]
    source: Option<Spanned<RawSource>>,
    /// The older form of a RabbitMQ source: the queue, with `dead_letter_queue`,
    /// `queue_type`, `queue_arguments` and `declare` beside it in the pipeline's table.
    #[serde(default, deserialize_with = "interpolated_spanned_option")]
    #[schemars(with = "Option<String>")]
    queue: Option<Spanned<String>>,
    /// The consumer name written in claims (default: the pipeline's name); several
    /// pipelines may share one.
    consumer: Option<String>,
    /// The plugin component (`.wasm`), relative to this file's directory.
    #[serde(deserialize_with = "interpolated_path")]
    plugin: PathBuf,
    /// The database its claims, effects and outbox rows live in: one of `[databases.<name>]`
    /// by name (default: `[database]`). The claim must be in the same database as the
    /// effects, so a pipeline's transaction is in exactly one.
    #[schemars(with = "Option<String>")]
    database: Option<Spanned<String>>,
    /// How a message is recognised as already applied (default `ledger`).
    #[serde(default = "default_claim")]
    #[schemars(with = "ClaimMode")]
    claim: Spanned<ClaimMode>,
    /// With `claim = "natural"`: the statement whose rows affected decide (0: a duplicate).
    #[schemars(with = "Option<String>")]
    claim_statement: Option<Spanned<String>>,
    /// Isolation, retries, role and timeouts of the message's transaction.
    #[serde(default)]
    transaction: TransactionConfig,
    /// Unacked deliveries the broker may send ahead (default 64).
    #[serde(default = "default_prefetch")]
    prefetch: NonZeroU16,
    /// Concurrent workers, each running one transaction at a time (default 4).
    #[serde(default = "default_workers")]
    workers: NonZeroUsize,
    /// Several messages per transaction.
    #[serde(default)]
    batch: BatchConfig,
    /// The older form's dead-letter queue (see `source`).
    #[serde(default, deserialize_with = "interpolated_option")]
    dead_letter_queue: Option<String>,
    /// The older form's queue type (see `source`).
    queue_type: Option<QueueType>,
    /// The older form's queue arguments (see `source`).
    #[schemars(with = "Option<BTreeMap<String, QueueArgument>>")]
    queue_arguments: Option<Spanned<BTreeMap<String, QueueArgument>>>,
    /// The older form's `declare` (see `source`).
    declare: Option<bool>,
    /// Tries of a message whose plugin failure is `retryable` (default 5).
    #[serde(default = "default_max_attempts")]
    max_attempts: NonZeroU32,
    /// The waits between those tries.
    #[schemars(with = "Option<RetryConfig>")]
    retry: Option<Spanned<RetryConfig>>,
    /// What one plugin call may consume.
    #[serde(default)]
    limits: PluginLimits,
    /// How long claims are kept.
    #[serde(default)]
    retention: RetentionConfig,
    /// A message body file every new plugin build must handle (decide or skip, with effects
    /// that fit their statements) before it serves.
    #[serde(default, deserialize_with = "interpolated_option")]
    self_test: Option<String>,
    /// A case file (`idem test`'s format) every new plugin build must pass before it serves;
    /// `idem check` runs it too.
    #[serde(default, deserialize_with = "interpolated_option")]
    cases: Option<String>,
    /// Hot-swap the plugin when its file changes (default `true`).
    #[serde(default = "default_watch")]
    watch: bool,
    /// The only SQL the plugin's effects can run: name = SQL with `$1`, `$2`, … parameters.
    #[schemars(with = "BTreeMap<String, String>")]
    statements: Spanned<BTreeMap<String, Spanned<String>>>,
}

impl RawPipeline {
    /// Pipeline `name` as written, checked; its `outbox` effects may name `outbox`'s
    /// destinations, and a RabbitMQ source's broker is `amqp`.
    pub(super) fn checked(
        self,
        name: String,
        databases: &BTreeMap<String, DatabaseConfig>,
        outbox: Option<&OutboxConfig>,
        amqp: Option<&AmqpConfig>,
        document: &Document,
    ) -> Result<PipelineConfig, ConfigError> {
        let table = Table {
            document,
            name: format!("pipelines.{name}"),
            span: None,
        };
        self.check_database(databases, &table)?;
        statements::check(&self.statements, &table)?;
        let claim = *self.claim.get_ref();
        let claim_statement = self.claim_statement(&table)?;
        let older = RabbitMqKeys {
            queue: self.queue,
            dead_letter_queue: self.dead_letter_queue,
            queue_type: self.queue_type,
            queue_arguments: self.queue_arguments,
            declare: self.declare,
        };
        let source = source::checked(self.source, older, &name, self.max_attempts, amqp, document)?;
        if self.transaction.timeout < Duration::from_secs(1) {
            return Err(table.at(
                None,
                "transaction.timeout",
                format!(
                    "{:?} is too short; the host's deadline for a transaction must be at least 1s",
                    self.transaction.timeout
                ),
            ));
        }
        let retry = RetryConfig::checked(self.retry, &table)?;
        Ok(PipelineConfig {
            retry,
            database: self.database.map(Spanned::into_inner),
            consumer: self.consumer.unwrap_or_else(|| name.clone()),
            plugin: document.resolve(&self.plugin),
            claim,
            claim_statement,
            transaction: self.transaction,
            outbox: outbox.cloned(),
            prefetch: self.prefetch,
            workers: self.workers,
            batch: self.batch,
            source,
            max_attempts: self.max_attempts,
            limits: self.limits,
            retention: self.retention,
            self_test: self.self_test.map(|path| document.resolve(path.as_ref())),
            cases: self.cases.map(|path| document.resolve(path.as_ref())),
            watch: self.watch,
            statements: self
                .statements
                .into_inner()
                .into_iter()
                .map(|(statement_name, sql)| (statement_name, sql.into_inner()))
                .collect(),
            name,
        })
    }

    /// `database`: one of the `[databases.<name>]` tables, when given.
    fn check_database(
        &self,
        databases: &BTreeMap<String, DatabaseConfig>,
        table: &Table,
    ) -> Result<(), ConfigError> {
        let Some(database) = &self.database else {
            return Ok(());
        };
        if databases.contains_key(database.get_ref()) {
            return Ok(());
        }
        let known = if databases.is_empty() {
            "there is no [databases.<name>] table; without database, a pipeline uses [database]"
                .to_string()
        } else {
            format!(
                "the named databases are {}; without database, a pipeline uses [database]",
                databases.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        };
        Err(table.at(
            Some(database.span()),
            "database",
            format!(
                "{:?} is not a [databases.<name>] table: {known}",
                database.get_ref()
            ),
        ))
    }

    /// `claim_statement`: one of the statements, given exactly when the claim is natural.
    fn claim_statement(&self, table: &Table) -> Result<Option<String>, ConfigError> {
        let claim = *self.claim.get_ref();
        match (claim, &self.claim_statement) {
            (ClaimMode::Natural, Some(statement)) => {
                let statements = self.statements.get_ref();
                if !statements.contains_key(statement.get_ref()) {
                    return Err(table.at(
                        Some(statement.span()),
                        "claim_statement",
                        format!(
                            "{:?} is not one of this pipeline's statements ({})",
                            statement.get_ref(),
                            statements.keys().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    ));
                }
                Ok(Some(statement.get_ref().clone()))
            }
            (ClaimMode::Natural, None) => Err(table.at(
                Some(self.claim.span()),
                "claim_statement",
                "claim = \"natural\" needs claim_statement, the statement whose rows affected decide (0 rows: duplicate)",
            )),
            (_, Some(statement)) => Err(table.at(
                Some(statement.span()),
                "claim_statement",
                format!(
                    "only used with claim = \"natural\", not {:?}",
                    claim.as_str()
                ),
            )),
            (_, None) => Ok(None),
        }
    }
}

fn default_claim() -> Spanned<ClaimMode> {
    Spanned::new(0..0, ClaimMode::Ledger)
}

fn default_watch() -> bool {
    true
}

fn default_batch_messages() -> NonZeroUsize {
    NonZeroUsize::new(64).expect("non-zero literal")
}

fn default_window() -> Duration {
    Duration::from_secs(30 * 86_400)
}

fn default_cleanup_batch() -> NonZeroU32 {
    NonZeroU32::new(10_000).expect("non-zero literal")
}

fn default_pause() -> Duration {
    Duration::from_millis(50)
}

fn default_every() -> Duration {
    Duration::from_secs(3_600)
}

fn default_prefetch() -> NonZeroU16 {
    NonZeroU16::new(64).expect("non-zero literal")
}

fn default_workers() -> NonZeroUsize {
    NonZeroUsize::new(4).expect("non-zero literal")
}

fn default_max_attempts() -> NonZeroU32 {
    NonZeroU32::new(5).expect("non-zero literal")
}

fn default_deadline_ms() -> NonZeroU32 {
    NonZeroU32::new(1_000).expect("non-zero literal")
}

fn default_memory_mib() -> NonZeroU32 {
    NonZeroU32::new(64).expect("non-zero literal")
}

fn default_max_effects() -> NonZeroUsize {
    NonZeroUsize::new(256).expect("non-zero literal")
}

fn default_messages_per_instance() -> NonZeroU32 {
    NonZeroU32::MIN
}
