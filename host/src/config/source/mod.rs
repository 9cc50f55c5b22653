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
    Document, Table, duration_option, duration_schema, interpolated_one_or_many_option,
    interpolated_option, interpolated_path_option, interpolated_spanned_list,
    interpolated_spanned_option,
};
use super::tls::ClientTls;

pub mod jetstream;
pub mod kafka;
pub mod rabbitmq;

use jetstream::{JetStreamConfig, JetStreamKeys};
use kafka::{Assignment, KafkaConfig, KafkaKeys, Ordering, PropertyValue, Sasl};
use rabbitmq::{AmqpConfig, QueueArgument, QueueType, RabbitMqConfig, RabbitMqKeys};

/// What a pipeline consumes (`[pipelines.<name>.source]`).
#[derive(Debug, Clone)]
pub enum SourceConfig {
    RabbitMq(RabbitMqConfig),
    JetStream(JetStreamConfig),
    Kafka(KafkaConfig),
}

impl SourceConfig {
    /// The kinds' names, as `kind` in the config and `message.source` for plugins.
    pub const RABBITMQ: &'static str = "rabbitmq";
    pub const JETSTREAM: &'static str = "jetstream";
    pub const KAFKA: &'static str = "kafka";

    /// The queue (or stream, or first topic) consumed, as logs, metrics and plugins name it.
    pub fn queue(&self) -> &str {
        match self {
            SourceConfig::RabbitMq(source) => &source.queue,
            SourceConfig::JetStream(source) => &source.stream,
            SourceConfig::Kafka(source) => &source.topics[0],
        }
    }

    /// Where rejected messages go: the dead-letter queue, subject or topic.
    pub fn dead_letter(&self) -> &str {
        match self {
            SourceConfig::RabbitMq(source) => &source.dead_letter_queue,
            SourceConfig::JetStream(source) => &source.dead_letter_subject,
            SourceConfig::Kafka(source) => &source.dead_letter_topic,
        }
    }

    /// The consumer group the pipeline reads in, as traces name it
    /// (`messaging.consumer.group.name`): a Kafka group, a JetStream durable consumer; none
    /// for a RabbitMQ queue.
    pub fn consumer_group(&self) -> Option<&str> {
        match self {
            SourceConfig::RabbitMq(_) => None,
            SourceConfig::JetStream(source) => Some(&source.consumer),
            SourceConfig::Kafka(source) => Some(&source.group),
        }
    }

    /// The kind of source, as plugins see it in `message.source`.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceConfig::RabbitMq(_) => SourceConfig::RABBITMQ,
            SourceConfig::JetStream(_) => SourceConfig::JETSTREAM,
            SourceConfig::Kafka(_) => SourceConfig::KAFKA,
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
    /// Apache Kafka topics, read by a consumer group.
    Kafka,
}

impl SourceKind {
    fn label(self) -> &'static str {
        match self {
            SourceKind::Rabbitmq => "RabbitMQ",
            SourceKind::Jetstream => "JetStream",
            SourceKind::Kafka => "Kafka",
        }
    }

    /// Every key a source of this kind reads.
    fn keys(self) -> &'static [&'static str] {
        match self {
            SourceKind::Rabbitmq => &RabbitMqKeys::KEYS,
            SourceKind::Jetstream => &JetStreamKeys::KEYS,
            SourceKind::Kafka => &KafkaKeys::KEYS,
        }
    }

    const ALL: [SourceKind; 3] = [
        SourceKind::Rabbitmq,
        SourceKind::Jetstream,
        SourceKind::Kafka,
    ];
}

/// Where a consumer idem starts, for the kinds that choose (`start`): JetStream takes
/// `window` and `all`, Kafka `window`, `earliest` and `latest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Start {
    /// No earlier than the claim window (with ledger claims): the default.
    Window,
    /// JetStream: the stream's first message, whatever its age.
    All,
    /// Kafka: a partition's earliest offset.
    Earliest,
    /// Kafka: a partition's end (only messages produced from now on).
    Latest,
}

/// `[pipelines.<name>.source]` as written.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSource {
    /// The kind of broker: `rabbitmq`, `jetstream` or `kafka`.
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
    /// JetStream and Kafka: TLS, required when this is set: `ca_file` (authorities trusted
    /// besides the system's store), `cert_file` and `key_file` (a client certificate, for
    /// servers that ask).
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
    /// Where a consumer idem creates starts: `"window"` (default; with ledger claims, no
    /// message older than the claim window); JetStream: `"all"` (the stream's first message,
    /// whatever its age); Kafka: `"earliest"` or `"latest"` (a partition's first offset, or
    /// its end), for a group without a committed offset.
    start: Option<Start>,
    /// Kafka: the bootstrap brokers (`host:port`).
    #[serde(default, deserialize_with = "interpolated_spanned_list")]
    #[schemars(with = "Option<Vec<String>>")]
    brokers: Option<Spanned<Vec<String>>>,
    /// Kafka: the topic consumed, or a list of them.
    #[serde(default, deserialize_with = "interpolated_one_or_many_option")]
    #[schemars(with = "Option<Vec<String>>")]
    topic: Option<Vec<String>>,
    /// Kafka: the consumer group (default `idem-<pipeline>`).
    #[serde(default, deserialize_with = "interpolated_option")]
    group: Option<String>,
    /// Kafka: where rejected messages are produced (default `<topic>.dead-letter`).
    #[serde(default, deserialize_with = "interpolated_option")]
    dead_letter_topic: Option<String>,
    /// Kafka: `"key"` (default: one key of a partition at a time, in offset order),
    /// `"partition"` (one message of a partition at a time) or `"none"`.
    ordering: Option<Ordering>,
    /// Kafka: `"range"` (default) or `"cooperative-sticky"` (only moved partitions revoked).
    assignment: Option<Assignment>,
    /// Kafka: SASL credentials: `mechanism` (`PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512`),
    /// `username`, `password` (use `${VAR}`).
    sasl: Option<Sasl>,
    /// Kafka: partitions of a topic idem creates with `declare` (default 1).
    partitions: Option<i32>,
    /// Kafka: messages of one partition received and not settled at most; past it the
    /// partition is paused while polling goes on (default 1000).
    in_flight_per_partition: Option<usize>,
    /// Kafka: how long a revoke waits for the revoked partitions' transactions (default 10s).
    #[serde(default, deserialize_with = "duration_option")]
    #[schemars(schema_with = "duration_schema")]
    revoke_timeout: Option<Duration>,
    /// Kafka: librdkafka properties idem does not set itself, passed through
    /// (`"session.timeout.ms" = 6000`).
    properties: Option<BTreeMap<String, PropertyValue>>,
}

impl RawSource {
    /// The kind, and the keys as each kind reads them.
    fn split(self) -> (SourceKind, RabbitMqKeys, JetStreamKeys, KafkaKeys) {
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
        let kafka = KafkaKeys {
            brokers: self.brokers,
            topic: self.topic,
            group: self.group,
            dead_letter_topic: self.dead_letter_topic,
            ordering: self.ordering,
            start: self.start,
            assignment: self.assignment,
            tls: jetstream.tls.clone(),
            sasl: self.sasl,
            declare: self.declare,
            partitions: self.partitions,
            in_flight_per_partition: self.in_flight_per_partition,
            revoke_timeout: self.revoke_timeout,
            properties: self.properties,
        };
        (self.kind, rabbitmq, jetstream, kafka)
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
    let (kind, rabbitmq, jetstream, kafka) = table.into_inner().split();
    let mut set: Vec<&str> = rabbitmq.set();
    set.extend(jetstream.set());
    set.extend(kafka.set());
    if let Some(key) = set.iter().find(|key| !kind.keys().contains(key)) {
        let takers: Vec<&str> = SourceKind::ALL
            .into_iter()
            .filter(|other| other.keys().contains(key))
            .map(SourceKind::label)
            .collect();
        return Err(table_at.at(
            None,
            key,
            format!(
                "a {} setting; a {} source does not take it",
                takers.join(" and "),
                kind.label()
            ),
        ));
    }
    match kind {
        SourceKind::Rabbitmq => Ok(SourceConfig::RabbitMq(rabbitmq.checked(&table_at, amqp)?)),
        SourceKind::Jetstream => Ok(SourceConfig::JetStream(jetstream.checked(
            name,
            max_attempts,
            &table_at,
        )?)),
        SourceKind::Kafka => Ok(SourceConfig::Kafka(kafka.checked(name, &table_at)?)),
    }
}
