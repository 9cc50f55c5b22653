//! What a pipeline consumes: `[pipelines.<name>.source]`, whose `kind` chooses the broker.
//!
//! The table is read as one set of keys (TOML cannot tag a table by one of its keys and keep
//! the lines of the others), and split here into each kind's keys: a key of the other kind
//! is refused by name. Each kind checks its own keys in its own file. This is the one place
//! in `config` that names every kind.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::text::{
    Document, Table, duration_option, duration_schema, interpolated_option,
    interpolated_path_option, interpolated_spanned_list, interpolated_spanned_option,
};
use super::tls::ClientTls;

pub mod jetstream;
pub mod kafka;
pub mod rabbitmq;

use jetstream::{ConsumerStart, JetStreamConfig, JetStreamKeys};
use rabbitmq::{AmqpConfig, QueueArgument, QueueType, RabbitMqConfig, RabbitMqKeys};

/// What a pipeline consumes (`[pipelines.<name>.source]`).
#[derive(Debug, Clone)]
pub enum SourceConfig {
    RabbitMq(RabbitMqConfig),
    JetStream(JetStreamConfig),
}

impl SourceConfig {
    /// The kinds' names, as `kind` in the config and `message.source` for plugins.
    pub const RABBITMQ: &'static str = "rabbitmq";
    pub const JETSTREAM: &'static str = "jetstream";

    /// The queue (or stream) consumed, as logs, metrics and plugins name it.
    pub fn queue(&self) -> &str {
        match self {
            SourceConfig::RabbitMq(source) => &source.queue,
            SourceConfig::JetStream(source) => &source.stream,
        }
    }

    /// Where rejected messages go: the dead-letter queue, or subject.
    pub fn dead_letter(&self) -> &str {
        match self {
            SourceConfig::RabbitMq(source) => &source.dead_letter_queue,
            SourceConfig::JetStream(source) => &source.dead_letter_subject,
        }
    }

    /// The kind of source, as plugins see it in `message.source`.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceConfig::RabbitMq(_) => SourceConfig::RABBITMQ,
            SourceConfig::JetStream(_) => SourceConfig::JETSTREAM,
        }
    }
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
pub(super) struct RawSource {
    /// The kind of broker: `rabbitmq` or `jetstream`.
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
    /// system's store), `cert_file` and `key_file` (a client certificate, for servers that ask).
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
    /// JetStream: deliveries of a message the server makes at most (default: no limit; more
    /// than `max_attempts` when set).
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
    /// The kind, and the keys as each kind reads them.
    fn split(self) -> (SourceKind, RabbitMqKeys, JetStreamKeys) {
        let rabbitmq = RabbitMqKeys {
            queue: self.queue,
            dead_letter_queue: self.dead_letter_queue,
            queue_type: self.queue_type,
            queue_arguments: self.queue_arguments,
            declare: self.declare,
        };
        let jetstream = JetStreamKeys {
            servers: self.servers,
            user: self.user,
            password: self.password,
            token: self.token,
            credentials_file: self.credentials_file,
            tls: self.tls,
            stream: self.stream,
            subject: self.subject,
            consumer: self.consumer,
            declare: self.declare,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
            dead_letter_subject: self.dead_letter_subject,
            dead_letter_stream: self.dead_letter_stream,
            in_progress: self.in_progress,
            start: self.start,
        };
        (self.kind, rabbitmq, jetstream)
    }
}

/// Pipeline `name`'s source: its `[pipelines.<name>.source]` table, or the older form's
/// RabbitMQ keys beside it in the pipeline's table (`older`), never both. `max_attempts` is
/// the pipeline's tries of a message; `amqp` the `[amqp]` table, a RabbitMQ source's broker.
pub(super) fn checked(
    table: Option<Spanned<RawSource>>,
    older: RabbitMqKeys,
    name: &str,
    max_attempts: NonZeroU32,
    amqp: Option<&AmqpConfig>,
    document: &Document,
) -> Result<SourceConfig, ConfigError> {
    let Some(table) = table else {
        if older.set().is_empty() {
            return Err(document.invalid(format!(
                "pipelines.{name}: no source: add [pipelines.{name}.source] with kind = \"rabbitmq\" and queue = \"…\""
            )));
        }
        let table = Table {
            document,
            name: format!("pipelines.{name}"),
            span: None,
        };
        return Ok(SourceConfig::RabbitMq(older.checked(&table, amqp)?));
    };
    let span = table.span();
    if !older.set().is_empty() {
        return Err(document.at(
            Some(span),
            &format!("pipelines.{name}.source"),
            "the queue's keys (queue, dead_letter_queue, queue_type, queue_arguments, declare) go inside [pipelines.<name>.source] when it is given, not beside it",
        ));
    }
    let table_at = Table {
        document,
        name: format!("pipelines.{name}.source"),
        span: Some(span),
    };
    let (kind, rabbitmq, jetstream) = table.into_inner().split();
    let foreign = |key: Option<&&str>, problem: &str| match key {
        Some(key) => Err(table_at.at(None, key, problem)),
        None => Ok(()),
    };
    match kind {
        SourceKind::Rabbitmq => {
            foreign(
                jetstream.set().first(),
                "a JetStream setting; a RabbitMQ source names a queue",
            )?;
            Ok(SourceConfig::RabbitMq(rabbitmq.checked(&table_at, amqp)?))
        }
        SourceKind::Jetstream => {
            let set = rabbitmq.set();
            foreign(
                set.iter().find(|key| **key != "declare"),
                "a RabbitMQ setting; a JetStream source names a stream (and subject)",
            )?;
            Ok(SourceConfig::JetStream(jetstream.checked(
                name,
                max_attempts,
                &table_at,
            )?))
        }
    }
}
