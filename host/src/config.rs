//! `pipelines.toml`: what to consume, which plugin decides, which SQL it may run.
//!
//! The file is parsed and validated once, in [`Config::load`].
//! Every error names the file, the line and the key, and unknown keys are refused.
//! String values that name endpoints or paths may use `${VAR}` or `${VAR:-default}`.

use std::collections::BTreeMap;
use std::num::{NonZeroU16, NonZeroU32, NonZeroUsize};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer};
use toml::Spanned;

/// A loaded and validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    pub database: DatabaseConfig,
    /// The RabbitMQ broker; present whenever a pipeline or an outbox destination uses it.
    pub amqp: Option<AmqpConfig>,
    /// The HTTP endpoint (`/metrics`, `/healthz`, `/readyz`, `/admin/…`); none when absent.
    pub http: Option<HttpConfig>,
    /// Pipelines by name, in name order.
    pub pipelines: Vec<PipelineConfig>,
    /// The `[outbox]` table: destinations and the relay; none when absent.
    pub outbox: Option<OutboxConfig>,
    /// The `[plugin_pool]` table.
    pub plugin_pool: PluginPoolConfig,
}

/// The `[plugin_pool]` table: wasmtime's pooling allocator keeps instance slots (memories,
/// tables, stacks) mapped, so a message's fresh instance costs no mmap or munmap.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginPoolConfig {
    /// Default true; false allocates each instance on demand.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Plugin instances that may exist at once. Default: every pipeline's workers, plus one
    /// per pipeline (a hot swap's self-test), plus 4.
    pub instances: Option<NonZeroU32>,
}

impl Default for PluginPoolConfig {
    fn default() -> Self {
        PluginPoolConfig {
            enabled: true,
            instances: None,
        }
    }
}

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

/// The `[amqp]` table.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AmqpConfig {
    /// An `amqp://` or `amqps://` (TLS) URL, vhost included (`%2f` for `/`).
    #[serde(deserialize_with = "interpolated")]
    pub url: String,
    /// TLS settings for an `amqps://` URL.
    #[serde(default)]
    pub tls: Option<ClientTls>,
}

/// The `[amqp.tls]` table, and a JetStream source's `tls`. Relative paths resolve against the
/// config file's directory. The server's certificate must always name the URL's host.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    /// PEM file of the certificate authorities that may sign the server's certificate, trusted
    /// besides the usual public roots.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for brokers that require one (mutual TLS).
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub key_file: Option<PathBuf>,
}

/// The `[http]` table.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address to listen on; loopback by default.
    #[serde(default = "default_listen")]
    #[schemars(with = "String")]
    pub listen: std::net::SocketAddr,
    /// Bearer token required by every action on `/admin/…`, and by every read when `listen` is
    /// not a loopback address; mandatory then.
    #[serde(default, deserialize_with = "interpolated_option")]
    pub admin_token: Option<String>,
    /// Serve the operator console at `/` (default `true`): pipelines, dead letters, outbox.
    #[serde(default = "default_true")]
    pub console: bool,
}

/// One `[pipelines.<name>]` table: a source, a plugin and the statements it may use.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// The table name, used in logs, metrics and the plugin's `message.pipeline`.
    pub name: String,
    /// What the pipeline consumes, and from which kind of broker.
    pub source: SourceConfig,
    /// The consumer name written in claims; several consumers may share one ledger.
    pub consumer: String,
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

/// What a pipeline consumes (`[pipelines.<name>.source]`).
#[derive(Debug, Clone)]
#[expect(
    clippy::large_enum_variant,
    reason = "one per pipeline, read once at start: boxing would buy nothing"
)]
pub enum SourceConfig {
    RabbitMq(RabbitMqSource),
    JetStream(JetStreamSource),
}

impl SourceConfig {
    /// The kinds' names, as `kind` in the config and `message.source` for plugins.
    pub const RABBITMQ: &'static str = "rabbitmq";
    pub const JETSTREAM: &'static str = "jetstream";
}

/// A NATS JetStream stream, read through a durable pull consumer.
#[derive(Debug, Clone)]
pub struct JetStreamSource {
    /// NATS server URLs (`nats://host:4222`); the client fails over between them.
    pub servers: Vec<String>,
    /// Credentials, when the server asks for them.
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// A NATS credentials file (a user JWT and its NKey seed), as NGS or an operator-mode
    /// server hands out.
    pub credentials_file: Option<PathBuf>,
    /// TLS: required when set (also with a `nats://` URL), with these authorities and client
    /// certificate; a `tls://` URL alone uses the public roots.
    pub tls: Option<ClientTls>,
    pub stream: String,
    /// The subject filter of the consumer; the stream's subjects when absent.
    pub subject: Option<String>,
    /// The durable consumer's name.
    pub consumer: String,
    /// `true`: the stream, the consumer and the dead-letter stream are created when missing
    /// (and an existing consumer must match); `false`: they must exist and are used as they are.
    pub declare: bool,
    /// How long the server waits for an ack before delivering the message again.
    pub ack_wait: Duration,
    /// Deliveries of one message the server makes at most (`None`: no limit).
    pub max_deliver: Option<i64>,
    /// Where rejected messages are published, with the reason in their headers.
    pub dead_letter_subject: String,
    /// The stream that keeps the dead letters (created with `declare`).
    pub dead_letter_stream: String,
    /// Tell the server the message is still being worked on (`+WPI`) while its handling
    /// outlives half of `ack_wait`.
    pub in_progress: bool,
    /// Where a consumer idem creates starts on the stream.
    pub start: ConsumerStart,
    /// The table these keys are written in, for messages that name a setting.
    pub table: String,
}

/// Where a consumer idem creates (the first time, or after an operator deleted it) starts on
/// its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ConsumerStart {
    /// With ledger claims, no earlier than the claim window (`retention.window`): an older
    /// message may have been applied already, and no claim is left to recognise it. Natural
    /// and `none` claims recognise what they applied for ever: they start at the first message.
    Window,
    /// At the stream's first message, whatever its age.
    All,
}

/// A RabbitMQ queue and its dead-letter queue.
#[derive(Debug, Clone)]
pub struct RabbitMqSource {
    pub queue: String,
    /// Where rejected messages go, with the reason in their headers.
    pub dead_letter_queue: String,
    /// The queue's type when idem declares it (and its dead-letter queue).
    pub queue_type: QueueType,
    /// Extra `x-…` arguments the queue is declared with (`x-delivery-limit`, `x-max-length`…).
    pub queue_arguments: BTreeMap<String, QueueArgument>,
    /// `false`: the queue belongs to infrastructure code; idem checks it exists and never
    /// declares or changes it.
    pub declare: bool,
    /// The table these keys are written in (`pipelines.<name>.source`, or `pipelines.<name>`
    /// in the older form), so a message naming a setting names it where it is.
    pub table: String,
}

/// A RabbitMQ queue type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// A single-node queue (RabbitMQ's default).
    #[default]
    Classic,
    /// A replicated Raft queue, with a delivery limit; what replicated setups use.
    Quorum,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// One `queue_arguments` value, as TOML writes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum QueueArgument {
    Integer(i64),
    Boolean(bool),
    Text(String),
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
    /// partial batch (default 0: only what the broker already delivered).
    #[serde(default = "default_linger", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub linger: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            size: default_batch_messages(),
            linger: default_linger(),
        }
    }
}

/// The `[pipelines.<name>.transaction]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TransactionConfig {
    #[serde(default)]
    pub isolation: Isolation,
    /// Serialization failures (40001) and deadlocks (40P01) retried before the message is
    /// requeued for a later delivery. Connection errors are retried without limit.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// A Postgres role the effects run as (`SET LOCAL ROLE`); the claim runs as the host.
    #[serde(default, deserialize_with = "interpolated_option")]
    pub role: Option<String>,
    /// The server cancels any one statement of the transaction after this long
    /// (`SET LOCAL statement_timeout`; 57014, retried). Default 10 s; `0s` turns it off.
    #[serde(default = "default_statement_timeout", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub statement_timeout: Duration,
    /// The server gives up waiting for a lock after this long (`SET LOCAL lock_timeout`;
    /// 55P03, retried). Default 5 s; `0s` turns it off.
    #[serde(default = "default_lock_timeout", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub lock_timeout: Duration,
    /// The host's deadline for the whole transaction, from taking a connection to `COMMIT`'s
    /// answer. Past it the connection is abandoned (closed, never reused) and the transaction
    /// retried on a new one: this is what notices a half-open connection. Default 20 s.
    #[serde(default = "default_transaction_timeout", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub timeout: Duration,
}

impl Default for TransactionConfig {
    fn default() -> Self {
        TransactionConfig {
            isolation: Isolation::default(),
            retries: default_retries(),
            role: None,
            statement_timeout: default_statement_timeout(),
            lock_timeout: default_lock_timeout(),
            timeout: default_transaction_timeout(),
        }
    }
}

impl TransactionConfig {
    /// The statement that opens the transaction: isolation and server-side timeouts in one
    /// round trip.
    pub fn begin_sql(&self) -> String {
        format!(
            "BEGIN ISOLATION LEVEL {}; SET LOCAL statement_timeout = {}; SET LOCAL lock_timeout = {}",
            self.isolation.sql(),
            self.statement_timeout.as_millis(),
            self.lock_timeout.as_millis()
        )
    }
}

/// Transaction isolation level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    #[default]
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    /// The SQL words, for `SET TRANSACTION ISOLATION LEVEL …`.
    pub fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// The `[outbox]` table: where `outbox` effects may go, and how the relay delivers them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    /// Destinations by name; a plugin's `outbox` effect names one.
    pub destinations: BTreeMap<String, Destination>,
    /// Run the relay in this host (several hosts may; rows are taken with SKIP LOCKED).
    #[serde(default = "default_relay")]
    pub relay: bool,
    /// How often the relay looks for rows other hosts wrote.
    #[serde(default = "default_poll", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub poll: Duration,
    /// Rows delivered per relay transaction.
    #[serde(default = "default_outbox_batch")]
    pub batch_size: NonZeroU32,
    /// Attempts before a row is parked with its last error.
    #[serde(default = "default_outbox_attempts")]
    pub max_attempts: NonZeroU32,
    /// Delivered rows older than this are deleted.
    #[serde(default = "default_outbox_retention", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub retention: Duration,
}

/// One `[outbox.destinations.<name>]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Destination {
    /// `POST` the payload to `url` with an `Idempotency-Key` header; any 2xx confirms.
    Http {
        #[serde(deserialize_with = "interpolated")]
        url: String,
        #[serde(default = "default_http_timeout", deserialize_with = "duration")]
        #[schemars(schema_with = "duration_schema")]
        timeout: Duration,
        /// For an `https://` url: PEM file of the only certificate authorities trusted to
        /// sign the endpoint's certificate (default: the system's roots).
        #[serde(default, deserialize_with = "interpolated_path_option")]
        ca_file: Option<PathBuf>,
    },
    /// Publish to `exchange` on the `[amqp]` broker with publisher confirms, persistent,
    /// `mandatory` (an unroutable message is a failed attempt), `message-id` = the key.
    Amqp {
        exchange: String,
        #[serde(default)]
        routing_key: String,
    },
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
    #[serde(default = "default_batch_size")]
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
            batch_size: default_batch_size(),
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
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let file: PipelinesFile =
            toml::from_str(text).map_err(|error| invalid(error.to_string()))?;
        let base_dir = path.parent().unwrap_or(Path::new("."));
        let outbox = match file.outbox {
            Some(spanned) => {
                let span = spanned.span();
                let mut outbox = spanned.into_inner();
                for (destination, kind) in &mut outbox.destinations {
                    let Destination::Http { url, ca_file, .. } = kind else {
                        continue;
                    };
                    let problem = if !url.starts_with("http://") && !url.starts_with("https://") {
                        Some(format!("url: {url:?} must be an http:// or https:// URL"))
                    } else if ca_file.is_some() && !url.starts_with("https://") {
                        Some(format!(
                            "ca_file: only used with an https:// url, not {url:?}"
                        ))
                    } else {
                        None
                    };
                    if let Some(problem) = problem {
                        return Err(invalid(format!(
                            "line {}: outbox.destinations.{destination}.{problem}",
                            line_of(text, span.start)
                        )));
                    }
                    if let Some(ca_file) = ca_file {
                        *ca_file = base_dir.join(&*ca_file);
                    }
                }
                Some(outbox)
            }
            None => None,
        };
        let mut pipelines = Vec::with_capacity(file.pipelines.len());
        for (name, raw) in file.pipelines {
            let at = |span: Range<usize>, key: &str, problem: String| {
                invalid(format!(
                    "line {}: pipelines.{name}.{key}: {problem}",
                    line_of(text, span.start)
                ))
            };
            if raw.statements.get_ref().is_empty() {
                return Err(at(
                    raw.statements.span(),
                    "statements",
                    "a pipeline needs at least one named statement".into(),
                ));
            }
            for (statement_name, sql) in raw.statements.get_ref() {
                if sql.get_ref().trim().is_empty() {
                    return Err(at(
                        sql.span(),
                        &format!("statements.{statement_name}"),
                        "statement is empty".into(),
                    ));
                }
            }
            let claim = *raw.claim.get_ref();
            let claim_statement = match (claim, raw.claim_statement) {
                (ClaimMode::Natural, Some(statement)) => {
                    if !raw.statements.get_ref().contains_key(statement.get_ref()) {
                        return Err(at(
                            statement.span(),
                            "claim_statement",
                            format!(
                                "{:?} is not one of this pipeline's statements ({})",
                                statement.get_ref(),
                                raw.statements
                                    .get_ref()
                                    .keys()
                                    .cloned()
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ),
                        ));
                    }
                    Some(statement.into_inner())
                }
                (ClaimMode::Natural, None) => {
                    return Err(at(
                        raw.claim.span(),
                        "claim_statement",
                        "claim = \"natural\" needs claim_statement, the statement whose rows affected decide (0 rows: duplicate)".into(),
                    ));
                }
                (_, Some(statement)) => {
                    return Err(at(
                        statement.span(),
                        "claim_statement",
                        format!(
                            "only used with claim = \"natural\", not {:?}",
                            claim.as_str()
                        ),
                    ));
                }
                (_, None) => None,
            };
            let legacy = RabbitMqKeys {
                queue: raw.queue,
                dead_letter_queue: raw.dead_letter_queue,
                queue_type: raw.queue_type,
                queue_arguments: raw.queue_arguments,
                declare: raw.declare,
            };
            let source = match raw.source {
                Some(source) => {
                    let table_span = source.span();
                    let table = format!("pipelines.{name}.source");
                    if legacy.any() {
                        return Err(at(
                            table_span,
                            "source",
                            "the queue's keys (queue, dead_letter_queue, queue_type, queue_arguments, declare) go inside [pipelines.<name>.source] when it is given, not beside it".into(),
                        ));
                    }
                    let raw_source = source.into_inner();
                    let source_at = |span: Option<Range<usize>>, key: &str, problem: String| {
                        at(
                            span.unwrap_or(table_span.clone()),
                            &format!("source.{key}"),
                            problem,
                        )
                    };
                    match raw_source.kind {
                        SourceKind::Rabbitmq => {
                            if let Some(key) = raw_source.jetstream_keys().first() {
                                return Err(source_at(
                                    None,
                                    key,
                                    "a JetStream setting; a RabbitMQ source names a queue".into(),
                                ));
                            }
                            let keys = RabbitMqKeys {
                                queue: raw_source.queue,
                                dead_letter_queue: raw_source.dead_letter_queue,
                                queue_type: raw_source.queue_type,
                                queue_arguments: raw_source.queue_arguments,
                                declare: raw_source.declare,
                            };
                            SourceConfig::RabbitMq(keys.source(&table, source_at)?)
                        }
                        SourceKind::Jetstream => {
                            let source =
                                raw_source.jetstream(&name, &table, base_dir, source_at)?;
                            // The server counts deliveries, idem the plugin's tries: a limit
                            // that leaves no room for every try would have the server abandon
                            // a message idem still means to retry.
                            let attempts = i64::from(raw.max_attempts.get());
                            if let Some(max_deliver) = source.max_deliver
                                && max_deliver <= attempts
                            {
                                return Err(source_at(
                                    None,
                                    "max_deliver",
                                    format!(
                                        "{max_deliver} leaves no room for max_attempts = {attempts}: a delivery is also spent by every restart, crash or late ack; set it above {attempts} (or leave it out for no limit)"
                                    ),
                                ));
                            }
                            SourceConfig::JetStream(source)
                        }
                    }
                }
                None if legacy.any() => {
                    let table = format!("pipelines.{name}");
                    SourceConfig::RabbitMq(legacy.source(
                        &table,
                        |span, key, problem| match span {
                            Some(span) => at(span, key, problem),
                            None => invalid(format!("pipelines.{name}.{key}: {problem}")),
                        },
                    )?)
                }
                None => {
                    return Err(invalid(format!(
                        "pipelines.{name}: no source: add [pipelines.{name}.source] with kind = \"rabbitmq\" and queue = \"…\""
                    )));
                }
            };
            if raw.transaction.timeout < Duration::from_secs(1) {
                return Err(invalid(format!(
                    "pipelines.{name}.transaction.timeout: {:?} is too short; the host's deadline for a transaction must be at least 1s",
                    raw.transaction.timeout
                )));
            }
            pipelines.push(PipelineConfig {
                consumer: raw.consumer.unwrap_or_else(|| name.clone()),
                plugin: base_dir.join(raw.plugin),
                claim,
                claim_statement,
                transaction: raw.transaction,
                outbox: outbox.clone(),
                prefetch: raw.prefetch,
                workers: raw.workers,
                batch: raw.batch,
                source,
                max_attempts: raw.max_attempts,
                limits: raw.limits,
                retention: raw.retention,
                self_test: raw.self_test.map(|self_test| base_dir.join(self_test)),
                cases: raw.cases.map(|cases| base_dir.join(cases)),
                watch: raw.watch,
                statements: raw
                    .statements
                    .into_inner()
                    .into_iter()
                    .map(|(statement_name, sql)| (statement_name, sql.into_inner()))
                    .collect(),
                name,
            });
        }
        let http = match file.http {
            Some(spanned) => {
                let span = spanned.span();
                let mut http = spanned.into_inner();
                http.admin_token = http.admin_token.filter(|token| !token.is_empty());
                if !http.listen.ip().is_loopback() && http.admin_token.is_none() {
                    return Err(invalid(format!(
                        "line {}: http.admin_token: required when http.listen ({}) is not a loopback address",
                        line_of(text, span.start),
                        http.listen
                    )));
                }
                Some(http)
            }
            None => None,
        };
        if pipelines.is_empty() {
            return Err(invalid(
                "no pipelines: add a [pipelines.<name>] table".into(),
            ));
        }
        let amqp = match file.amqp {
            Some(amqp) => {
                let span = amqp.span();
                Some(
                    checked_amqp(amqp.into_inner(), base_dir).map_err(|problem| {
                        invalid(format!(
                            "line {}: amqp.{problem}",
                            line_of(text, span.start)
                        ))
                    })?,
                )
            }
            None => {
                let rabbitmq_pipeline = pipelines
                    .iter()
                    .find(|pipeline| matches!(pipeline.source, SourceConfig::RabbitMq(_)))
                    .map(|pipeline| {
                        format!("pipeline {:?} consumes a RabbitMQ queue", pipeline.name)
                    });
                let amqp_destination = outbox.as_ref().and_then(|outbox| {
                    outbox
                        .destinations
                        .iter()
                        .find(|(_, destination)| matches!(destination, Destination::Amqp { .. }))
                        .map(|(name, _)| {
                            format!("outbox destination {name:?} is a RabbitMQ exchange")
                        })
                });
                if let Some(user) = rabbitmq_pipeline.or(amqp_destination) {
                    return Err(invalid(format!(
                        "amqp: missing: {user}; add [amqp] with url = \"amqp://…\""
                    )));
                }
                None
            }
        };
        Ok(Config {
            path: path.to_path_buf(),
            database: {
                let mut database = file.database;
                if let Some(tls) = &mut database.tls {
                    for path in [&mut tls.root_cert, &mut tls.cert, &mut tls.key]
                        .into_iter()
                        .flatten()
                    {
                        *path = base_dir.join(&*path);
                    }
                }
                database
            },
            amqp,
            http,
            pipelines,
            outbox,
            plugin_pool: file.plugin_pool.unwrap_or_default(),
        })
    }

    /// The pipeline called `name`, if configured.
    pub fn pipeline(&self, name: &str) -> Option<&PipelineConfig> {
        self.pipelines.iter().find(|pipeline| pipeline.name == name)
    }
}

impl PipelineConfig {
    /// The queue (or stream) consumed, as logs, metrics and plugins name it.
    pub fn queue(&self) -> &str {
        match &self.source {
            SourceConfig::RabbitMq(source) => &source.queue,
            SourceConfig::JetStream(source) => &source.stream,
        }
    }

    /// Where rejected messages go: the dead-letter queue, or subject.
    pub fn dead_letter(&self) -> &str {
        match &self.source {
            SourceConfig::RabbitMq(source) => &source.dead_letter_queue,
            SourceConfig::JetStream(source) => &source.dead_letter_subject,
        }
    }

    /// The kind of source, as plugins see it in `message.source`.
    pub fn source_kind(&self) -> &'static str {
        match &self.source {
            SourceConfig::RabbitMq(_) => SourceConfig::RABBITMQ,
            SourceConfig::JetStream(_) => SourceConfig::JETSTREAM,
        }
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

/// The file as written, before defaults that depend on other keys are filled in. Its doc
/// comments are the descriptions `idem schema` gives editors.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(
    title = "pipelines.toml",
    description = "The idem host's configuration: where the database and the broker are, and one [pipelines.<name>] table per consumed queue. Strings may use ${VAR} and ${VAR:-default}."
)]
struct PipelinesFile {
    /// PostgreSQL: the claims, the effects and the outbox live there.
    database: DatabaseConfig,
    /// RabbitMQ: required when a pipeline consumes a RabbitMQ queue or the outbox publishes to
    /// an exchange.
    #[schemars(with = "Option<AmqpConfig>")]
    amqp: Option<Spanned<AmqpConfig>>,
    /// The HTTP endpoint (`/metrics`, `/healthz`, `/readyz`, `/admin/…`); off when absent.
    #[schemars(with = "Option<HttpConfig>")]
    http: Option<Spanned<HttpConfig>>,
    /// One table per pipeline: a queue, a plugin and the statements it may use.
    #[serde(default)]
    pipelines: BTreeMap<String, RawPipeline>,
    /// The transactional outbox: destinations, and the relay that delivers after commit.
    #[schemars(with = "Option<OutboxConfig>")]
    outbox: Option<Spanned<OutboxConfig>>,
    /// wasmtime's pooling allocator for plugin instances.
    plugin_pool: Option<PluginPoolConfig>,
}

/// One `[pipelines.<name>]` table as written.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawPipeline {
    /// What the pipeline consumes: `kind = "rabbitmq"` and the queue.
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

/// The kinds of source a pipeline can consume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum SourceKind {
    /// A RabbitMQ queue.
    Rabbitmq,
    /// A NATS JetStream stream.
    Jetstream,
}

/// `[pipelines.<name>.source]` as written.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawSource {
    /// The kind of broker: `rabbitmq`.
    kind: SourceKind,
    /// The RabbitMQ queue this pipeline consumes.
    #[serde(default, deserialize_with = "interpolated_spanned_option")]
    #[schemars(with = "Option<String>")]
    queue: Option<Spanned<String>>,
    /// Where rejected messages go (default `<queue>.dead-letter`).
    #[serde(default, deserialize_with = "interpolated_option")]
    dead_letter_queue: Option<String>,
    /// The queue's type when idem declares it (default `classic`).
    queue_type: Option<QueueType>,
    /// Extra `x-…` arguments the queue is declared with (`x-delivery-limit`, `x-max-length`…).
    #[schemars(with = "Option<BTreeMap<String, QueueArgument>>")]
    queue_arguments: Option<Spanned<BTreeMap<String, QueueArgument>>>,
    /// RabbitMQ: `false`, the queue belongs to your infrastructure code; idem checks it exists
    /// and never declares or changes it. JetStream: `false`, the stream and the consumer must
    /// exist and are used as they are (default `true`).
    declare: Option<bool>,
    /// JetStream: the NATS server URLs (`nats://host:4222`).
    #[serde(default, deserialize_with = "interpolated_spanned_list")]
    #[schemars(with = "Option<Vec<String>>")]
    servers: Option<Spanned<Vec<String>>>,
    /// JetStream: the user, with `password`, when the server asks for one.
    #[serde(default, deserialize_with = "interpolated_option")]
    user: Option<String>,
    /// JetStream: the password of `user`.
    #[serde(default, deserialize_with = "interpolated_option")]
    password: Option<String>,
    /// JetStream: an authentication token, when the server asks for one.
    #[serde(default, deserialize_with = "interpolated_option")]
    token: Option<String>,
    /// JetStream: a credentials file (user JWT and NKey seed), instead of user/password or
    /// token. A relative path resolves against the config file's directory.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    credentials_file: Option<PathBuf>,
    /// JetStream: TLS, required when this is set: `ca_file` (authorities trusted besides the
    /// public roots), `cert_file` and `key_file` (a client certificate, for servers that ask).
    tls: Option<ClientTls>,
    /// JetStream: the stream this pipeline consumes.
    #[serde(default, deserialize_with = "interpolated_spanned_option")]
    #[schemars(with = "Option<String>")]
    stream: Option<Spanned<String>>,
    /// JetStream: the consumer's subject filter (default: every subject of the stream; the
    /// stream idem creates takes `<stream>.>` then).
    #[serde(default, deserialize_with = "interpolated_option")]
    subject: Option<String>,
    /// JetStream: the durable consumer's name (default `idem-<pipeline>`).
    #[serde(default, deserialize_with = "interpolated_option")]
    consumer: Option<String>,
    /// JetStream: how long the server waits for an ack before it delivers again (default 30s).
    #[serde(default, deserialize_with = "duration_option")]
    #[schemars(schema_with = "duration_schema")]
    ack_wait: Option<Duration>,
    /// JetStream: deliveries of a message the server makes at most (default: no limit).
    max_deliver: Option<i64>,
    /// JetStream: where rejected messages are published, outside the consumed subjects
    /// (default `<dead_letter_stream>.<pipeline>`).
    #[serde(default, deserialize_with = "interpolated_option")]
    dead_letter_subject: Option<String>,
    /// JetStream: the stream keeping the dead letters, created with `declare` (default
    /// `<stream>_DEAD_LETTERS`).
    #[serde(default, deserialize_with = "interpolated_option")]
    dead_letter_stream: Option<String>,
    /// JetStream: send in-progress acks while a message's handling outlives half of
    /// `ack_wait`, so the server does not deliver it again meanwhile (default `true`).
    in_progress: Option<bool>,
    /// JetStream: where a consumer idem creates starts: `"window"` (default; with ledger
    /// claims, no message older than the claim window) or `"all"` (the stream's first
    /// message, whatever its age).
    start: Option<ConsumerStart>,
}

impl RawSource {
    /// The JetStream-only keys that are set, by name.
    fn jetstream_keys(&self) -> Vec<&'static str> {
        [
            ("servers", self.servers.is_some()),
            ("user", self.user.is_some()),
            ("password", self.password.is_some()),
            ("token", self.token.is_some()),
            ("credentials_file", self.credentials_file.is_some()),
            ("tls", self.tls.is_some()),
            ("stream", self.stream.is_some()),
            ("subject", self.subject.is_some()),
            ("consumer", self.consumer.is_some()),
            ("ack_wait", self.ack_wait.is_some()),
            ("max_deliver", self.max_deliver.is_some()),
            ("dead_letter_subject", self.dead_letter_subject.is_some()),
            ("dead_letter_stream", self.dead_letter_stream.is_some()),
            ("in_progress", self.in_progress.is_some()),
            ("start", self.start.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect()
    }

    /// The JetStream source these keys describe, for pipeline `pipeline`.
    fn jetstream(
        self,
        pipeline: &str,
        table: &str,
        base_dir: &Path,
        at: impl Fn(Option<Range<usize>>, &str, String) -> ConfigError,
    ) -> Result<JetStreamSource, ConfigError> {
        for (key, set) in [
            ("queue", self.queue.is_some()),
            ("dead_letter_queue", self.dead_letter_queue.is_some()),
            ("queue_type", self.queue_type.is_some()),
            ("queue_arguments", self.queue_arguments.is_some()),
        ] {
            if set {
                return Err(at(
                    None,
                    key,
                    "a RabbitMQ setting; a JetStream source names a stream (and subject)".into(),
                ));
            }
        }
        let Some(stream) = self.stream else {
            return Err(at(
                None,
                "stream",
                "missing: the JetStream stream this pipeline consumes".into(),
            ));
        };
        let span = stream.span();
        let stream = stream.into_inner();
        let name_ok = |name: &str| {
            !name.is_empty()
                && name.len() <= 255
                && !name
                    .chars()
                    .any(|character| character.is_whitespace() || ".*>/\\".contains(character))
        };
        if !name_ok(&stream) {
            return Err(at(
                Some(span),
                "stream",
                format!(
                    "{stream:?}: a stream name is 1 to 255 bytes without spaces, '.', '*', '>', '/' or '\\'"
                ),
            ));
        }
        let servers = match self.servers {
            Some(servers) if servers.get_ref().is_empty() => {
                return Err(at(
                    Some(servers.span()),
                    "servers",
                    "give at least one NATS server URL".into(),
                ));
            }
            Some(servers) => servers.into_inner(),
            None => {
                return Err(at(
                    None,
                    "servers",
                    "missing: the NATS server URLs, e.g. [\"nats://127.0.0.1:4222\"]".into(),
                ));
            }
        };
        let ways = [
            self.user.is_some() || self.password.is_some(),
            self.token.is_some(),
            self.credentials_file.is_some(),
        ];
        if ways.iter().filter(|way| **way).count() > 1 {
            return Err(at(
                None,
                "credentials_file",
                "user/password, token and credentials_file are three ways to authenticate: give one".into(),
            ));
        }
        if self.user.is_some() != self.password.is_some() {
            return Err(at(
                None,
                if self.user.is_some() {
                    "password"
                } else {
                    "user"
                },
                "user and password go together".into(),
            ));
        }
        let mut tls = self.tls;
        if let Some(tls) = &mut tls {
            tls.resolve(base_dir)
                .map_err(|problem| at(None, "tls", problem.into()))?;
        }
        let consumer = self.consumer.unwrap_or_else(|| format!("idem-{pipeline}"));
        if !name_ok(&consumer) {
            return Err(at(
                None,
                "consumer",
                format!("{consumer:?}: a consumer name has no spaces, '.', '*', '>', '/' or '\\'"),
            ));
        }
        let ack_wait = self.ack_wait.unwrap_or(Duration::from_secs(30));
        if ack_wait < Duration::from_secs(1) {
            return Err(at(
                None,
                "ack_wait",
                format!("{ack_wait:?} is too short: at least 1s"),
            ));
        }
        if self.max_deliver.is_some_and(|max| max < 1) {
            return Err(at(
                None,
                "max_deliver",
                "at least 1 (leave it out for no limit)".into(),
            ));
        }
        let dead_letter_stream = self
            .dead_letter_stream
            .unwrap_or_else(|| format!("{stream}_DEAD_LETTERS"));
        if dead_letter_stream == stream || !name_ok(&dead_letter_stream) {
            return Err(at(
                None,
                "dead_letter_stream",
                format!("{dead_letter_stream:?}: a stream name of its own, other than {stream:?}"),
            ));
        }
        let dead_letter_subject = self
            .dead_letter_subject
            .unwrap_or_else(|| format!("{dead_letter_stream}.{pipeline}"));
        let consumed = self
            .subject
            .clone()
            .unwrap_or_else(|| format!("{stream}.>"));
        if subject_matches(&consumed, &dead_letter_subject) {
            return Err(at(
                None,
                "dead_letter_subject",
                format!(
                    "{dead_letter_subject:?} is consumed by the pipeline itself (subject {consumed:?}): a dead letter would come back; name a subject outside it"
                ),
            ));
        }
        Ok(JetStreamSource {
            servers,
            user: self.user,
            password: self.password,
            token: self.token,
            credentials_file: self.credentials_file.map(|path| base_dir.join(path)),
            tls,
            stream,
            subject: self.subject,
            consumer,
            declare: self.declare.unwrap_or(true),
            ack_wait,
            max_deliver: self.max_deliver,
            dead_letter_subject,
            dead_letter_stream,
            in_progress: self.in_progress.unwrap_or(true),
            start: self.start.unwrap_or(ConsumerStart::Window),
            table: table.to_string(),
        })
    }
}

/// Whether NATS subject `subject` is matched by `filter` (`*` one token, `>` the rest).
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for token in filter.split('.') {
        match (token, subject_tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (token, Some(other)) if token == other => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

/// A RabbitMQ source's keys, from `[pipelines.<name>.source]` or the older form.
struct RabbitMqKeys {
    queue: Option<Spanned<String>>,
    dead_letter_queue: Option<String>,
    queue_type: Option<QueueType>,
    queue_arguments: Option<Spanned<BTreeMap<String, QueueArgument>>>,
    declare: Option<bool>,
}

impl RabbitMqKeys {
    fn any(&self) -> bool {
        self.queue.is_some()
            || self.dead_letter_queue.is_some()
            || self.queue_type.is_some()
            || self.queue_arguments.is_some()
            || self.declare.is_some()
    }

    /// The source these keys describe; `table` is where they are written, `at` makes an
    /// error naming a key of that table and the line of `span` (`None`: the table's line).
    fn source(
        self,
        table: &str,
        at: impl Fn(Option<Range<usize>>, &str, String) -> ConfigError,
    ) -> Result<RabbitMqSource, ConfigError> {
        let Some(queue) = self.queue else {
            return Err(at(
                None,
                "queue",
                "missing: the RabbitMQ queue this pipeline consumes".into(),
            ));
        };
        let span = queue.span();
        let queue = queue.into_inner().trim().to_string();
        if queue.is_empty() || queue.len() > 255 {
            return Err(at(
                Some(span),
                "queue",
                "queue name must be 1 to 255 bytes".into(),
            ));
        }
        let dead_letter_queue = self
            .dead_letter_queue
            .unwrap_or_else(|| format!("{queue}.dead-letter"));
        if dead_letter_queue == queue {
            return Err(at(
                Some(span),
                "dead_letter_queue",
                format!("must differ from the queue {queue:?}"),
            ));
        }
        let declare = self.declare.unwrap_or(true);
        let queue_arguments = match self.queue_arguments {
            Some(arguments) => {
                let span = arguments.span();
                for argument in arguments.get_ref().keys() {
                    if !argument.starts_with("x-") || argument == "x-queue-type" {
                        return Err(at(
                            Some(span),
                            "queue_arguments",
                            format!(
                                "{argument:?}: queue arguments are RabbitMQ's `x-…` names; the type is set with queue_type"
                            ),
                        ));
                    }
                }
                if !declare && !arguments.get_ref().is_empty() {
                    return Err(at(
                        Some(span),
                        "queue_arguments",
                        "with declare = false idem never declares the queue, so its arguments are the infrastructure's to set; remove queue_arguments".into(),
                    ));
                }
                arguments.into_inner()
            }
            None => BTreeMap::new(),
        };
        Ok(RabbitMqSource {
            queue,
            dead_letter_queue,
            queue_type: self.queue_type.unwrap_or_default(),
            queue_arguments,
            declare,
            table: table.to_string(),
        })
    }
}

/// The JSON Schema of `pipelines.toml` (`idem schema`), for editors: every table and key with
/// its type and description. Defaults are stated in the descriptions (the generated ones
/// would show durations in their Rust form).
pub fn json_schema() -> serde_json::Value {
    fn strip_defaults(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(object) => {
                object.remove("default");
                object.values_mut().for_each(strip_defaults);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip_defaults),
            _ => {}
        }
    }
    let mut schema = schemars::schema_for!(PipelinesFile).to_value();
    strip_defaults(&mut schema);
    schema
}

/// A duration as `pipelines.toml` writes it.
fn duration_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "pattern": "^\\s*[0-9]+(ms|s|m|h|d)\\s*$",
        "examples": ["250ms", "30s", "5m", "12h", "30d"]
    })
}

fn default_listen() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 9464))
}

fn default_window() -> Duration {
    Duration::from_secs(30 * 86_400)
}

fn default_batch_size() -> NonZeroU32 {
    NonZeroU32::new(10_000).expect("non-zero literal")
}

fn default_pause() -> Duration {
    Duration::from_millis(50)
}

fn default_every() -> Duration {
    Duration::from_secs(3_600)
}

fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_duration(&text).map_err(serde::de::Error::custom)
}

fn duration_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Duration>, D::Error> {
    duration(deserializer).map(Some)
}

/// The `[amqp]` table with its URL checked and its TLS paths resolved; the problem names the
/// key.
fn checked_amqp(mut amqp: AmqpConfig, base_dir: &Path) -> Result<AmqpConfig, String> {
    let uri: lapin::uri::AMQPUri = amqp.url.parse().map_err(|error| {
        format!(
            "url: {:?} is not an AMQP URL: {error}",
            redact_url(&amqp.url)
        )
    })?;
    let secure = matches!(uri.scheme, lapin::uri::AMQPScheme::AMQPS);
    if let Some(tls) = &mut amqp.tls {
        if !secure {
            return Err(format!(
                "tls: set, but url {:?} is not amqps:// (TLS)",
                redact_url(&amqp.url)
            ));
        }
        tls.resolve(base_dir)
            .map_err(|problem| format!("tls: {problem}"))?;
    }
    Ok(amqp)
}

impl ClientTls {
    /// Checks that the client certificate comes with its key, and resolves the paths against
    /// the config file's directory.
    fn resolve(&mut self, base_dir: &Path) -> Result<(), &'static str> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err("cert_file and key_file go together (the client certificate and its key)");
        }
        for path in [&mut self.ca_file, &mut self.cert_file, &mut self.key_file]
            .into_iter()
            .flatten()
        {
            *path = base_dir.join(&*path);
        }
        Ok(())
    }
}

fn default_true() -> bool {
    true
}

fn default_watch() -> bool {
    true
}

fn default_max_connections() -> NonZeroU32 {
    NonZeroU32::new(16).expect("non-zero literal")
}

fn default_claim() -> Spanned<ClaimMode> {
    Spanned::new(0..0, ClaimMode::Ledger)
}

fn default_batch_messages() -> NonZeroUsize {
    NonZeroUsize::new(64).expect("non-zero literal")
}

/// No wait by default: a batch is whatever is already delivered, so a quiet queue gets no
/// added latency and a busy one gets full batches.
fn default_linger() -> Duration {
    Duration::ZERO
}

fn default_statement_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_lock_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_transaction_timeout() -> Duration {
    Duration::from_secs(20)
}

fn default_idle_in_transaction() -> Duration {
    Duration::from_secs(20)
}

fn default_keepalive() -> Duration {
    Duration::from_secs(30)
}

fn default_retries() -> u32 {
    10
}

fn default_relay() -> bool {
    true
}

fn default_poll() -> Duration {
    Duration::from_millis(250)
}

fn default_outbox_batch() -> NonZeroU32 {
    NonZeroU32::new(32).expect("non-zero literal")
}

fn default_outbox_attempts() -> NonZeroU32 {
    NonZeroU32::new(12).expect("non-zero literal")
}

fn default_outbox_retention() -> Duration {
    Duration::from_secs(7 * 86_400)
}

fn default_http_timeout() -> Duration {
    Duration::from_secs(10)
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

/// A service URL without its credentials, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    // As URL parsers read it: the authority ends at the first '/', '?' or '#', and its last
    // '@' ends the user information.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.to_ascii_lowercase().contains("pass") => {
                        format!("{key}=redacted")
                    }
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{scheme}://{host}{tail}")
}

/// Parses `30d`, `12h`, `90m`, `45s` or `250ms`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|character: char| !character.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 30d, 12h, 90m, 45s or 250ms"))?;
    let seconds = |factor: u64| Duration::from_secs(number.saturating_mul(factor));
    match unit {
        "d" => Ok(seconds(86_400)),
        "h" => Ok(seconds(3_600)),
        "m" => Ok(seconds(60)),
        "s" => Ok(seconds(1)),
        "ms" => Ok(Duration::from_millis(number)),
        _ => Err(format!(
            "{text:?} has no known unit: write 30d, 12h, 90m, 45s or 250ms"
        )),
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(0, |before| before.matches('\n').count())
        + 1
}

fn interpolated<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let raw = String::deserialize(deserializer)?;
    expand_env(&raw, |name| std::env::var(name).ok()).map_err(serde::de::Error::custom)
}

fn interpolated_spanned<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Spanned<String>, D::Error> {
    let raw = Spanned::<String>::deserialize(deserializer)?;
    let span = raw.span();
    let value = expand_env(raw.get_ref(), |name| std::env::var(name).ok())
        .map_err(serde::de::Error::custom)?;
    Ok(Spanned::new(span, value))
}

fn interpolated_spanned_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Spanned<String>>, D::Error> {
    interpolated_spanned(deserializer).map(Some)
}

fn interpolated_spanned_list<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Spanned<Vec<String>>>, D::Error> {
    let raw = Spanned::<Vec<String>>::deserialize(deserializer)?;
    let span = raw.span();
    let values = raw
        .into_inner()
        .iter()
        .map(|value| expand_env(value, |name| std::env::var(name).ok()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(serde::de::Error::custom)?;
    Ok(Some(Spanned::new(span, values)))
}

fn interpolated_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<String>, D::Error> {
    interpolated(deserializer).map(Some)
}

fn interpolated_path_option<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<PathBuf>, D::Error> {
    Ok(interpolated_option(deserializer)?.map(PathBuf::from))
}

fn interpolated_path<'de, D: Deserializer<'de>>(deserializer: D) -> Result<PathBuf, D::Error> {
    interpolated(deserializer).map(PathBuf::from)
}

/// Replaces `${NAME}` and `${NAME:-default}` with the variable's value.
/// An unset variable without a default is an error; `$` not followed by `{` is kept.
fn expand_env(raw: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut expanded = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        expanded.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("unclosed \"${{\" in {raw:?}"))?;
        let expression = &after[..end];
        let (name, default) = match expression.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (expression, None),
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|character| character.is_ascii_alphanumeric() || character == '_')
        {
            return Err(format!("invalid variable name {name:?} in {raw:?}"));
        }
        match (lookup(name).filter(|value| !value.is_empty()), default) {
            (Some(value), _) => expanded.push_str(&value),
            (None, Some(default)) => expanded.push_str(default),
            (None, None) => {
                return Err(format!(
                    "environment variable {name} is not set and has no default (write ${{{name}:-default}})"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    expanded.push_str(rest);
    Ok(expanded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_redact(url: &str, expected: &str) {
        assert_eq!(redact_url(url), expected);
    }

    #[test]
    fn redaction() {
        check_redact(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqp://127.0.0.1:5672/%2f",
        );
        check_redact("amqp://127.0.0.1", "amqp://127.0.0.1");
        check_redact("postgres://u:p@w@host/db", "postgres://host/db");
        check_redact("not a url", "not a url");
        check_redact(
            "postgres://host/db?user=u&password=secret&sslmode=require",
            "postgres://host/db?user=u&password=redacted&sslmode=require",
        );
        check_redact(
            "postgres://u@host/db?sslpassword=a@b",
            "postgres://host/db?sslpassword=redacted",
        );
    }

    #[track_caller]
    fn check_duration(text: &str, expected: Result<Duration, &str>) {
        match (parse_duration(text), expected) {
            (Ok(actual), Ok(expected)) => assert_eq!(actual, expected),
            (Err(error), Err(fragment)) => assert!(error.contains(fragment), "{error}"),
            (actual, expected) => panic!("{text:?}: {actual:?} vs {expected:?}"),
        }
    }

    #[test]
    fn duration_parsing() {
        check_duration("30d", Ok(Duration::from_secs(30 * 86_400)));
        check_duration("12h", Ok(Duration::from_secs(12 * 3_600)));
        check_duration("90m", Ok(Duration::from_secs(90 * 60)));
        check_duration("45s", Ok(Duration::from_secs(45)));
        check_duration("250ms", Ok(Duration::from_millis(250)));
        check_duration("0s", Ok(Duration::ZERO));
        check_duration("30", Err("no known unit"));
        check_duration("d", Err("not a duration"));
        check_duration("3w", Err("no known unit"));
    }

    #[track_caller]
    fn check_expand(raw: &str, expected: Result<&str, &str>) {
        let lookup = |name: &str| match name {
            "SET" => Some("value".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        let actual = expand_env(raw, lookup);
        match expected {
            Ok(expected) => assert_eq!(actual.as_deref(), Ok(expected)),
            Err(fragment) => {
                let error = actual.expect_err("expected an error");
                assert!(error.contains(fragment), "{error:?} lacks {fragment:?}");
            }
        }
    }

    #[test]
    fn env_expansion() {
        check_expand("plain", Ok("plain"));
        check_expand("${SET}", Ok("value"));
        check_expand("a-${SET}-b", Ok("a-value-b"));
        check_expand("${UNSET:-fallback}", Ok("fallback"));
        check_expand("${EMPTY:-fallback}", Ok("fallback"));
        check_expand("${SET:-fallback}", Ok("value"));
        check_expand("${UNSET:-}", Ok(""));
        check_expand("cost $5", Ok("cost $5"));
        check_expand("${UNSET}", Err("UNSET is not set"));
        check_expand("${SET", Err("unclosed"));
        check_expand("${bad name}", Err("invalid variable name"));
    }

    const VALID: &str = r#"
[database]
url = "postgres://127.0.0.1/db"

[amqp]
url = "amqp://127.0.0.1"

[pipelines.loyalty]
queue = "order-completed"
plugin = "plugins/loyalty.wasm"

[pipelines.loyalty.statements]
credit = "UPDATE balances SET points = points + $2 WHERE customer_id = $1"
"#;

    fn rabbitmq(pipeline: &PipelineConfig) -> &RabbitMqSource {
        let SourceConfig::RabbitMq(source) = &pipeline.source else {
            panic!("a RabbitMQ source, not {:?}", pipeline.source);
        };
        source
    }

    /// A JetStream source: its defaults, and the keys of one kind refused on the other.
    #[test]
    fn a_jetstream_source() {
        let jetstream = |keys: &str| {
            VALID.replace("queue = \"order-completed\"\n", "")
                + "\n[pipelines.loyalty.source]\nkind = \"jetstream\"\n"
                + keys
        };
        let config = Config::from_toml(
            Path::new("/etc/idem/pipelines.toml"),
            &jetstream("servers = [\"nats://127.0.0.1:4222\"]\nstream = \"ORDERS\"\nsubject = \"orders.completed\"\n"),
        )
        .expect("a JetStream source");
        let pipeline = &config.pipelines[0];
        let SourceConfig::JetStream(source) = &pipeline.source else {
            panic!("not JetStream: {:?}", pipeline.source);
        };
        assert_eq!(source.consumer, "idem-loyalty");
        assert_eq!(source.ack_wait, Duration::from_secs(30));
        assert_eq!(source.max_deliver, None);
        assert_eq!(source.dead_letter_subject, "ORDERS_DEAD_LETTERS.loyalty");
        assert_eq!(source.dead_letter_stream, "ORDERS_DEAD_LETTERS");
        assert!(source.declare && source.in_progress);
        assert_eq!(pipeline.queue(), "ORDERS");
        assert_eq!(pipeline.source_kind(), "jetstream");

        let without_amqp =
            jetstream("servers = [\"nats://127.0.0.1:4222\"]\nstream = \"ORDERS\"\n")
                .replace("[amqp]\nurl = \"amqp://127.0.0.1\"\n", "");
        let config = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &without_amqp)
            .expect("a stream-only config needs no [amqp]");
        assert!(config.amqp.is_none());
        check_error(
            &VALID.replace("[amqp]\nurl = \"amqp://127.0.0.1\"\n", ""),
            &[
                "amqp: missing",
                "pipeline \"loyalty\" consumes a RabbitMQ queue",
            ],
        );
        check_error(
            &jetstream(
                "servers = [\"nats://h\"]\nstream = \"ORDERS\"\nsubject = \"orders.>\"\ndead_letter_subject = \"orders.dead\"\n",
            ),
            &[
                "pipelines.loyalty.source.dead_letter_subject",
                "consumed by the pipeline itself",
            ],
        );
        assert!(subject_matches("orders.*.eu", "orders.created.eu"));
        assert!(!subject_matches("orders.*", "orders.created.eu"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(subject_matches("orders", "orders"));
        check_error(
            &jetstream("servers = [\"nats://127.0.0.1:4222\"]\n"),
            &["pipelines.loyalty.source.stream", "missing"],
        );
        check_error(
            &jetstream("stream = \"ORDERS\"\n"),
            &["pipelines.loyalty.source.servers", "missing"],
        );
        check_error(
            &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nqueue = \"q\"\n"),
            &["pipelines.loyalty.source.queue", "RabbitMQ setting"],
        );
        check_error(
            &jetstream("servers = [\"nats://h\"]\nstream = \"OR.DERS\"\n"),
            &["pipelines.loyalty.source.stream", "OR.DERS"],
        );
        check_error(
            &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nack_wait = \"10ms\"\n"),
            &["pipelines.loyalty.source.ack_wait", "at least 1s"],
        );
        // The default max_attempts is 5: a server limit of 5 deliveries leaves no room.
        check_error(
            &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nmax_deliver = 5\n"),
            &[
                "pipelines.loyalty.source.max_deliver",
                "leaves no room for max_attempts = 5",
            ],
        );
        let config = Config::from_toml(
            Path::new("/etc/idem/pipelines.toml"),
            &jetstream(
                "servers = [\"nats://h\"]\nstream = \"ORDERS\"\nmax_deliver = 6\nstart = \"all\"\n",
            ),
        )
        .unwrap_or_else(|error| panic!("{error}"));
        let SourceConfig::JetStream(source) = &config.pipelines[0].source else {
            panic!("a JetStream source");
        };
        assert_eq!(source.start, ConsumerStart::All);
        check_error(
            &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nstart = \"first\"\n"),
            &["start", "first"],
        );
        check_error(
            &(VALID.replace("queue = \"order-completed\"\n", "")
                + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"q\"\nstream = \"S\"\n"),
            &["pipelines.loyalty.source.stream", "JetStream setting"],
        );
    }

    /// `[pipelines.<name>.source]` and the older form beside it describe the same source;
    /// both at once, or neither, are refused with the form to use.
    #[test]
    fn a_source_table_or_the_older_queue_keys() {
        let source_form = VALID.replace("queue = \"order-completed\"\n", "")
            + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"order-completed\"\nqueue_type = \"quorum\"\ndeclare = false\n";
        let config = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &source_form)
            .expect("the source form");
        let source = rabbitmq(&config.pipelines[0]);
        assert_eq!(source.queue, "order-completed");
        assert_eq!(source.dead_letter_queue, "order-completed.dead-letter");
        assert_eq!(source.queue_type, QueueType::Quorum);
        assert!(!source.declare);
        assert_eq!(source.table, "pipelines.loyalty.source");
        let older = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), VALID)
            .expect("the older form");
        assert_eq!(rabbitmq(&older.pipelines[0]).table, "pipelines.loyalty");
        assert_eq!(older.pipelines[0].queue(), "order-completed");

        check_error(
            &(VALID.to_string()
                + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"other\"\n"),
            &[
                "line 15",
                "pipelines.loyalty.source",
                "inside [pipelines.<name>.source]",
            ],
        );
        check_error(
            &VALID.replace("queue = \"order-completed\"\n", ""),
            &["pipelines.loyalty: no source", "kind = \"rabbitmq\""],
        );
        check_error(
            &(VALID.replace("queue = \"order-completed\"\n", "")
                + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\n"),
            &["pipelines.loyalty.source.queue", "missing"],
        );
        check_error(
            &(VALID.replace("queue = \"order-completed\"\n", "")
                + "\n[pipelines.loyalty.source]\nkind = \"kafka\"\nqueue = \"q\"\n"),
            &["kafka", "rabbitmq"],
        );
        check_error(
            &(VALID.replace("queue = \"order-completed\"\n", "")
                + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"q\"\ndead_letter_queue = \"q\"\n"),
            &[
                "line 16",
                "pipelines.loyalty.source.dead_letter_queue",
                "must differ",
            ],
        );
    }

    #[track_caller]
    fn check_error(text: &str, fragments: &[&str]) {
        let error = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), text)
            .expect_err("config should be refused")
            .to_string();
        assert!(error.contains("/etc/idem/pipelines.toml"), "{error}");
        for fragment in fragments {
            assert!(error.contains(fragment), "{error:?} lacks {fragment:?}");
        }
    }

    #[test]
    fn defaults_and_resolution() {
        let config =
            Config::from_toml(Path::new("/etc/idem/pipelines.toml"), VALID).expect("valid config");
        let pipeline = config.pipeline("loyalty").expect("pipeline loyalty");
        assert_eq!(pipeline.consumer, "loyalty");
        assert_eq!(pipeline.dead_letter(), "order-completed.dead-letter");
        assert_eq!(pipeline.plugin, Path::new("/etc/idem/plugins/loyalty.wasm"));
        assert_eq!(pipeline.claim, ClaimMode::Ledger);
        assert_eq!(pipeline.limits, PluginLimits::default());
        assert_eq!(pipeline.statements.len(), 1);
    }

    #[test]
    fn errors_name_line_and_key() {
        check_error(
            &VALID.replace("queue = ", "queue_name = "),
            &["line 9", "unknown field `queue_name`"],
        );
        check_error(
            &VALID.replace("plugin = ", "workers = 0\nplugin = "),
            &["line 10", "workers"],
        );
        check_error(
            &VALID.replace(
                "[pipelines.loyalty]\n",
                "[pipelines.loyalty]\nclaim = \"redis\"\n",
            ),
            &["line 9", "claim", "ledger"],
        );
        check_error(
            &VALID.replace("credit = \"UPDATE", "credit = \"  \"\nx = \"UPDATE"),
            &["line 13", "pipelines.loyalty.statements.credit", "empty"],
        );
        check_error(
            &VALID.replace("\"order-completed\"", "\"${IDEM_TEST_UNSET_QUEUE}\""),
            &["line 9", "IDEM_TEST_UNSET_QUEUE is not set"],
        );
        check_error("[amqp]\nurl = \"x\"\n", &["missing field `database`"]);
        check_error(
            &format!("{VALID}\n[http]\nlisten = \"0.0.0.0:9464\"\n"),
            &["http.admin_token: required"],
        );
    }

    #[test]
    fn connectivity_settings_are_checked() {
        let tls = |url: &str, table: &str| {
            VALID.replace(
                "[amqp]\nurl = \"amqp://127.0.0.1\"\n",
                &format!("[amqp]\nurl = \"{url}\"\n\n[amqp.tls]\n{table}\n"),
            )
        };
        check_error(
            &tls("amqp://127.0.0.1", "ca_file = \"ca.pem\""),
            &["line 5", "amqp.tls", "not amqps://"],
        );
        check_error(
            &tls("amqps://127.0.0.1", "cert_file = \"client.pem\""),
            &["amqp.tls", "cert_file and key_file go together"],
        );
        check_error(
            &VALID.replace("amqp://127.0.0.1", "http://127.0.0.1"),
            &["amqp.url", "is not an AMQP URL"],
        );
        let config = Config::from_toml(
            Path::new("/etc/idem/pipelines.toml"),
            &tls("amqps://127.0.0.1", "ca_file = \"ca.pem\""),
        )
        .expect("amqps with a CA");
        assert_eq!(
            config
                .amqp
                .and_then(|amqp| amqp.tls)
                .and_then(|tls| tls.ca_file),
            Some(PathBuf::from("/etc/idem/ca.pem"))
        );

        let queue = |keys: &str| {
            VALID.replace(
                "plugin = \"plugins/loyalty.wasm\"\n",
                &format!("plugin = \"plugins/loyalty.wasm\"\n{keys}\n"),
            )
        };
        check_error(
            &queue("declare = false\nqueue_arguments = { \"x-delivery-limit\" = 5 }"),
            &[
                "line 12",
                "pipelines.loyalty.queue_arguments",
                "declare = false",
            ],
        );
        check_error(
            &queue("queue_arguments = { \"x-queue-type\" = \"quorum\" }"),
            &["pipelines.loyalty.queue_arguments", "queue_type"],
        );
        check_error(&queue("queue_type = \"stream\""), &["queue_type", "quorum"]);
        let config = Config::from_toml(
            Path::new("/etc/idem/pipelines.toml"),
            &queue("queue_type = \"quorum\"\nqueue_arguments = { \"x-delivery-limit\" = 5 }"),
        )
        .expect("a quorum queue");
        let source = rabbitmq(&config.pipelines[0]);
        assert_eq!(source.queue_type, QueueType::Quorum);
        assert_eq!(
            source.queue_arguments.get("x-delivery-limit"),
            Some(&QueueArgument::Integer(5))
        );

        let destination =
            |keys: &str| format!("{VALID}\n[outbox.destinations.hook]\nkind = \"http\"\n{keys}\n");
        check_error(
            &destination("url = \"ftp://example.com\""),
            &["outbox.destinations.hook.url", "http:// or https://"],
        );
        check_error(
            &destination("url = \"http://example.com\"\nca_file = \"ca.pem\""),
            &["outbox.destinations.hook.ca_file", "https://"],
        );
        let config = Config::from_toml(
            Path::new("/etc/idem/pipelines.toml"),
            &destination("url = \"https://example.com\"\nca_file = \"ca.pem\""),
        )
        .expect("an https destination");
        let outbox = config.outbox.expect("outbox");
        assert!(matches!(
            outbox.destinations.get("hook"),
            Some(Destination::Http { ca_file: Some(path), .. }) if path == Path::new("/etc/idem/ca.pem")
        ));
    }

    #[test]
    fn the_schema_names_every_table_and_pipeline_key() {
        let schema = json_schema();
        let properties = |value: &serde_json::Value| -> Vec<String> {
            value["properties"]
                .as_object()
                .map(|object| object.keys().cloned().collect())
                .unwrap_or_default()
        };
        let top = properties(&schema);
        for table in [
            "database",
            "amqp",
            "http",
            "pipelines",
            "outbox",
            "plugin_pool",
        ] {
            assert!(
                top.contains(&table.to_string()),
                "{table} missing from {top:?}"
            );
        }
        assert_eq!(schema["additionalProperties"], false);
        let pipeline = &schema["$defs"]["RawPipeline"];
        let keys = properties(pipeline);
        for key in [
            "queue",
            "plugin",
            "claim",
            "statements",
            "cases",
            "self_test",
            "limits",
        ] {
            assert!(
                keys.contains(&key.to_string()),
                "{key} missing from {keys:?}"
            );
        }
        assert_eq!(pipeline["additionalProperties"], false);
        assert_eq!(
            pipeline["required"],
            serde_json::json!(["plugin", "statements"])
        );
        let source = &schema["$defs"]["RawSource"];
        assert_eq!(source["required"], serde_json::json!(["kind"]));
        assert_eq!(source["additionalProperties"], false);
        let window = &schema["$defs"]["RetentionConfig"]["properties"]["window"];
        assert_eq!(window["type"], "string", "{window}");
        assert!(
            !schema.to_string().contains("\"default\""),
            "defaults are described, not generated"
        );
    }
}
