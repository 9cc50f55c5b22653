//! An Apache Kafka source: `[pipelines.<name>.source]` with `kind = "kafka"`, every setting of
//! it and every check of them.

use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::super::ConfigError;
use super::super::text::Table;
use super::super::tls::ClientTls;
use super::Start;

/// A Kafka topic (or several) read by one consumer of a consumer group.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// `host:port` of the bootstrap brokers.
    pub brokers: Vec<String>,
    /// The topics consumed.
    pub topics: Vec<String>,
    /// The consumer group (`group.id`).
    pub group: String,
    /// Where rejected messages are produced, with the reason in their headers.
    pub dead_letter_topic: String,
    pub ordering: Ordering,
    /// Where a group without a committed offset starts on a partition.
    pub start: KafkaStart,
    pub assignment: Assignment,
    /// TLS: the brokers are reached over TLS, with these authorities and client certificate.
    pub tls: Option<ClientTls>,
    /// SASL authentication, over TLS when `tls` is set.
    pub sasl: Option<Sasl>,
    /// `true`: the topics are created when missing (with `partitions`); `false`: they must
    /// exist.
    pub declare: bool,
    /// Partitions of a topic idem creates.
    pub partitions: i32,
    /// Messages of one partition received and not settled at most: past it the partition is
    /// paused (polling goes on), and resumed at half.
    pub in_flight_per_partition: usize,
    /// How long a revoke waits for the revoked partitions' transactions in flight.
    pub revoke_timeout: Duration,
    /// librdkafka properties idem does not name, passed through as written.
    pub properties: BTreeMap<String, String>,
    /// The table these keys are written in, for messages that name a setting.
    pub table: String,
}

/// How a Kafka source orders the messages of a partition (`ordering`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Ordering {
    /// Messages of one partition with the same Kafka key, one at a time in offset order;
    /// messages without a key are not ordered.
    Key,
    /// Every message of a partition one at a time in offset order.
    Partition,
    /// No order: any message may be applied beside any other.
    None,
}

/// Where a group without a committed offset starts on a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaStart {
    /// At the first message of the claim window (with ledger claims; else the earliest).
    Window,
    Earliest,
    Latest,
}

/// How the group's partitions are assigned (`partition.assignment.strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Assignment {
    /// Every member gives up all its partitions at a rebalance (eager).
    Range,
    /// Only the partitions that move are revoked (incremental).
    CooperativeSticky,
}

impl Assignment {
    /// librdkafka's name of the strategy.
    pub fn strategy(self) -> &'static str {
        match self {
            Assignment::Range => "range",
            Assignment::CooperativeSticky => "cooperative-sticky",
        }
    }
}

/// SASL credentials (`[pipelines.<name>.source.sasl]`).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Sasl {
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`.
    pub mechanism: SaslMechanism,
    #[serde(deserialize_with = "super::super::text::interpolated")]
    pub username: String,
    /// Use `${VAR}`: the password should not be in the file.
    #[serde(deserialize_with = "super::super::text::interpolated")]
    pub password: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
pub enum SaslMechanism {
    #[serde(rename = "PLAIN")]
    Plain,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    pub fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// A property value as written: TOML strings, numbers and booleans, passed as text.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum PropertyValue {
    Text(String),
    Integer(i64),
    Boolean(bool),
}

impl PropertyValue {
    fn text(&self) -> String {
        match self {
            PropertyValue::Text(text) => text.clone(),
            PropertyValue::Integer(number) => number.to_string(),
            PropertyValue::Boolean(flag) => flag.to_string(),
        }
    }
}

/// The librdkafka properties idem sets itself: given in `properties`, they are refused, naming
/// the setting that decides them.
const OWN_PROPERTIES: [(&str, &str); 12] = [
    ("bootstrap.servers", "brokers"),
    ("group.id", "group"),
    (
        "enable.auto.commit",
        "(idem commits the settled floor itself)",
    ),
    (
        "enable.auto.offset.store",
        "(idem commits the settled floor itself)",
    ),
    ("auto.offset.reset", "start"),
    ("partition.assignment.strategy", "assignment"),
    ("security.protocol", "tls and sasl"),
    ("sasl.mechanism", "sasl.mechanism"),
    ("sasl.mechanisms", "sasl.mechanism"),
    ("sasl.username", "sasl.username"),
    ("sasl.password", "sasl.password"),
    (
        "enable.idempotence",
        "(the dead-letter producer is always idempotent)",
    ),
];

/// A Kafka source's keys as written.
pub(in crate::config) struct KafkaKeys {
    pub brokers: Option<Spanned<Vec<String>>>,
    pub topic: Option<Vec<String>>,
    pub group: Option<String>,
    pub dead_letter_topic: Option<String>,
    pub ordering: Option<Ordering>,
    pub start: Option<Start>,
    pub assignment: Option<Assignment>,
    pub tls: Option<ClientTls>,
    pub sasl: Option<Sasl>,
    pub declare: Option<bool>,
    pub partitions: Option<i32>,
    pub in_flight_per_partition: Option<usize>,
    pub revoke_timeout: Option<Duration>,
    pub properties: Option<BTreeMap<String, PropertyValue>>,
}

impl KafkaKeys {
    /// Every key a Kafka source reads, in the order `set` reads them.
    pub const KEYS: [&'static str; 14] = [
        "brokers",
        "topic",
        "group",
        "dead_letter_topic",
        "ordering",
        "start",
        "assignment",
        "tls",
        "sasl",
        "declare",
        "partitions",
        "in_flight_per_partition",
        "revoke_timeout",
        "properties",
    ];

    /// The keys set, by name. Every field is named here (no `..`): a new key does not compile
    /// until it is counted.
    pub fn set(&self) -> Vec<&'static str> {
        let KafkaKeys {
            brokers,
            topic,
            group,
            dead_letter_topic,
            ordering,
            start,
            assignment,
            tls,
            sasl,
            declare,
            partitions,
            in_flight_per_partition,
            revoke_timeout,
            properties,
        } = self;
        let set: [bool; Self::KEYS.len()] = [
            brokers.is_some(),
            topic.is_some(),
            group.is_some(),
            dead_letter_topic.is_some(),
            ordering.is_some(),
            start.is_some(),
            assignment.is_some(),
            tls.is_some(),
            sasl.is_some(),
            declare.is_some(),
            partitions.is_some(),
            in_flight_per_partition.is_some(),
            revoke_timeout.is_some(),
            properties.is_some(),
        ];
        Self::KEYS
            .into_iter()
            .zip(set)
            .filter_map(|(key, set)| set.then_some(key))
            .collect()
    }

    /// The source these keys describe for pipeline `pipeline`, written in `table`.
    pub fn checked(self, pipeline: &str, table: &Table) -> Result<KafkaConfig, ConfigError> {
        let brokers = brokers(self.brokers, table)?;
        let topics = topics(self.topic, table)?;
        let dead_letter_topic = dead_letter_topic(self.dead_letter_topic, &topics, table)?;
        let start = start(self.start, table)?;
        let partitions = self.partitions.unwrap_or(1);
        if partitions < 1 {
            return Err(table.at(None, "partitions", "at least 1"));
        }
        let in_flight_per_partition = self.in_flight_per_partition.unwrap_or(1000);
        if in_flight_per_partition < 1 {
            return Err(table.at(None, "in_flight_per_partition", "at least 1"));
        }
        let tls = match self.tls {
            Some(tls) => Some(
                tls.checked(table.document)
                    .map_err(|problem| table.at(None, "tls", problem))?,
            ),
            None => None,
        };
        Ok(KafkaConfig {
            brokers,
            topics,
            group: self.group.unwrap_or_else(|| format!("idem-{pipeline}")),
            dead_letter_topic,
            ordering: self.ordering.unwrap_or(Ordering::Key),
            start,
            assignment: self.assignment.unwrap_or(Assignment::Range),
            tls,
            sasl: self.sasl,
            declare: self.declare.unwrap_or(true),
            partitions,
            in_flight_per_partition,
            revoke_timeout: self.revoke_timeout.unwrap_or(Duration::from_secs(10)),
            properties: properties(self.properties.unwrap_or_default(), table)?,
            table: table.name.clone(),
        })
    }
}

/// The bootstrap brokers: at least one.
fn brokers(
    brokers: Option<Spanned<Vec<String>>>,
    table: &Table,
) -> Result<Vec<String>, ConfigError> {
    match brokers {
        Some(brokers) if brokers.get_ref().is_empty() => Err(table.at(
            Some(brokers.span()),
            "brokers",
            "give at least one broker, e.g. [\"127.0.0.1:9092\"]",
        )),
        Some(brokers) => Ok(brokers.into_inner()),
        None => Err(table.at(
            None,
            "brokers",
            "missing: the bootstrap brokers, e.g. [\"127.0.0.1:9092\"]",
        )),
    }
}

/// The dead-letter topic: given, or `<topic>.dead-letter` for one topic; never a consumed one.
fn dead_letter_topic(
    given: Option<String>,
    topics: &[String],
    table: &Table,
) -> Result<String, ConfigError> {
    let topic = match (given, topics) {
        (Some(topic), _) => topic,
        (None, [topic]) => format!("{topic}.dead-letter"),
        (None, _) => {
            return Err(table.at(
                None,
                "dead_letter_topic",
                "missing: with several topics, name the one dead letters go to",
            ));
        }
    };
    if !topic_name_ok(&topic) || topics.contains(&topic) {
        return Err(table.at(
            None,
            "dead_letter_topic",
            format!(
                "{topic:?}: a topic of its own, other than the consumed ones (letters, digits, '.', '_', '-'; at most 249)"
            ),
        ));
    }
    Ok(topic)
}

/// Where a group without a committed offset starts: `window` (default), `earliest`, `latest`.
fn start(start: Option<Start>, table: &Table) -> Result<KafkaStart, ConfigError> {
    match start {
        None | Some(Start::Window) => Ok(KafkaStart::Window),
        Some(Start::Earliest) => Ok(KafkaStart::Earliest),
        Some(Start::Latest) => Ok(KafkaStart::Latest),
        Some(Start::All) => Err(table.at(
            None,
            "start",
            "\"all\" is JetStream's; a Kafka source starts at \"window\", \"earliest\" or \"latest\"",
        )),
    }
}

/// The topics consumed: at least one, each a valid name.
fn topics(topics: Option<Vec<String>>, table: &Table) -> Result<Vec<String>, ConfigError> {
    let topics = topics.unwrap_or_default();
    if topics.is_empty() {
        return Err(table.at(
            None,
            "topic",
            "missing: the Kafka topic this pipeline consumes (or a list of them)",
        ));
    }
    if let Some(bad) = topics.iter().find(|topic| !topic_name_ok(topic)) {
        return Err(table.at(
            None,
            "topic",
            format!(
                "{bad:?}: a topic name is 1 to 249 letters, digits, '.', '_' or '-' (a pattern is not taken)"
            ),
        ));
    }
    Ok(topics)
}

/// The pass-through properties as text, none of them one idem sets itself.
fn properties(
    written: BTreeMap<String, PropertyValue>,
    table: &Table,
) -> Result<BTreeMap<String, String>, ConfigError> {
    for (name, setting) in OWN_PROPERTIES {
        if written.contains_key(name) {
            return Err(table.at(
                None,
                "properties",
                format!("{name:?} is idem's to set: use {setting}"),
            ));
        }
    }
    Ok(written
        .into_iter()
        .map(|(name, value)| (name, value.text()))
        .collect())
}

/// Whether Kafka takes `name` as a topic: 1 to 249 of `[A-Za-z0-9._-]`, not `.` or `..`.
fn topic_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 249
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|character| character.is_ascii_alphanumeric() || "._-".contains(character))
}
