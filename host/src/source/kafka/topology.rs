//! The topics a Kafka source needs: the consumed ones and the dead-letter topic, found in
//! the cluster's metadata, created when missing with `declare` (`partitions` each, the
//! brokers' default replication), refused by name without it.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::types::RDKafkaErrorCode;

use crate::config::KafkaConfig;

use super::{KafkaError, connect};

/// How long a metadata or admin request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A consumer outside the group's membership, for metadata, offsets, ends and dead letters.
/// It keeps the last refusal librdkafka reported as a global error (a failed TLS handshake, a
/// refused login), which a request that failed only says as a transport failure or a timeout.
pub type Reader = BaseConsumer<Recorder>;

/// A reader's context: the last refusal among librdkafka's global errors, with its reason,
/// naming a setting of `table`.
pub struct Recorder {
    table: String,
    refused: std::sync::Mutex<Option<KafkaError>>,
}

impl rdkafka::ClientContext for Recorder {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, line: &str) {
        tracing::debug!(?level, facility, "librdkafka: {line}");
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "librdkafka reader error");
        // A transport failure right after a failed handshake must not hide it.
        if let Some(refused) = KafkaError::refused(&self.table, &error, Some(reason)) {
            *self
                .refused
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(refused);
        }
    }
}

impl rdkafka::consumer::ConsumerContext for Recorder {}

/// A reader of `source`'s brokers, named `client` in their logs.
pub fn reader(source: &KafkaConfig, client: &str) -> Result<Reader, KafkaError> {
    connect::reader(source, client)
        .create_with_context(Recorder {
            table: source.table.clone(),
            refused: std::sync::Mutex::default(),
        })
        .map_err(|error| KafkaError::Client(error.to_string()))
}

/// Why `reader`'s request failed with `error`: a refusal it recorded (stop, naming the
/// setting), or the brokers unreachable (retry).
pub fn failed(
    reader: &Reader,
    source: &KafkaConfig,
    error: &rdkafka::error::KafkaError,
) -> KafkaError {
    // librdkafka reports a failed handshake or login as an event the next poll serves.
    let _ = reader.poll(Duration::from_millis(100));
    let recorded = reader
        .context()
        .refused
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    recorded.unwrap_or_else(|| unreachable_or_refused(source, error))
}

/// The partition count of each topic the cluster has, of those asked for (blocking).
pub fn partitions(
    reader: &Reader,
    source: &KafkaConfig,
    topics: &[String],
) -> Result<BTreeMap<String, usize>, KafkaError> {
    let metadata = reader
        .fetch_metadata(None, REQUEST_TIMEOUT)
        .map_err(|error| failed(reader, source, &error))?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|topic| topics.iter().any(|wanted| wanted == topic.name()))
        .filter(|topic| topic.error().is_none() && !topic.partitions().is_empty())
        .map(|topic| (topic.name().to_string(), topic.partitions().len()))
        .collect())
}

/// The brokers could not be reached (retry), or refused us (stop, naming the setting).
pub fn unreachable_or_refused(
    source: &KafkaConfig,
    error: &rdkafka::error::KafkaError,
) -> KafkaError {
    KafkaError::refused(&source.table, error, None).unwrap_or_else(|| KafkaError::Connect {
        brokers: source.brokers.join(","),
        reason: error.to_string(),
    })
}

/// Makes sure the consumed topics and the dead-letter topic exist: created when missing
/// with `declare`, else refused naming them.
pub async fn ensure_topics(source: &KafkaConfig, client: &str) -> Result<(), KafkaError> {
    let mut wanted = source.topics.clone();
    wanted.push(source.dead_letter_topic.clone());
    let found = {
        let source = source.clone();
        let client = client.to_string();
        let wanted = wanted.clone();
        tokio::task::spawn_blocking(move || {
            let reader = reader(&source, &client)?;
            partitions(&reader, &source, &wanted)
        })
        .await
        .map_err(|error| KafkaError::Client(error.to_string()))??
    };
    let missing: Vec<&String> = wanted
        .iter()
        .filter(|topic| !found.contains_key(*topic))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !source.declare {
        return Err(KafkaError::Refused {
            reason: format!(
                "the topics {missing:?} do not exist, and declare = false leaves them to you"
            ),
            setting: format!("{}.topic (or declare = true)", source.table),
        });
    }
    let admin: AdminClient<DefaultClientContext> = connect::common(source, client)
        .create()
        .map_err(|error| KafkaError::Client(error.to_string()))?;
    let topics: Vec<NewTopic<'_>> = missing
        .iter()
        .map(|topic| NewTopic::new(topic, source.partitions, TopicReplication::Fixed(-1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT));
    let results = admin
        .create_topics(&topics, &options)
        .await
        .map_err(|error| unreachable_or_refused(source, &error))?;
    for result in results {
        match result {
            Ok(topic) => tracing::info!(topic, "Created the Kafka topic."),
            // Another host created it meanwhile.
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(KafkaError::Request {
                    action: "create the topic",
                    name: topic,
                    reason: code.to_string(),
                });
            }
        }
    }
    Ok(())
}
