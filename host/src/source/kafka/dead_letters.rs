//! A Kafka pipeline's dead letters, read for
//! [`source::dead_letters`](crate::source::dead_letters): the records on its dead-letter
//! topic that this pipeline wrote.
//!
//! A topic cannot delete one record, so a dead letter replayed or discarded is marked: the
//! host appends a marker (an empty record with `x-idem-settled: <partition>:<offset>`) to the
//! dead-letter topic, and a pass skips marked letters and the markers. A replayed copy is
//! produced to the topic it was consumed from and acknowledged by the brokers before its
//! marker is written: a failure between the two replays it twice at worst, and the claim
//! makes the second copy a duplicate.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError as ClientError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::config::{KafkaConfig, PipelineConfig};
use crate::message::InboundMessage;
use crate::source::dead_letters::{Action, DeadLetter, SCAN_MESSAGES, Selection, Walk};
use crate::source::headers;

use super::topology::{REQUEST_TIMEOUT, Reader, failed, partitions, reader};
use super::{KIND, KafkaError, connect};

/// How long a pass reads the dead-letter topic at most before it stops where it is.
const READ_FOR: Duration = Duration::from_secs(60);

/// A record of the dead-letter topic, as read.
struct Stored {
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Stored {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .and_then(|(_, value)| value.as_deref())
            .map(|value| String::from_utf8_lossy(value).into_owned())
    }

    fn id(&self) -> String {
        format!("{}:{}", self.partition, self.offset)
    }
}

/// Goes once through the dead letters `pipeline` wrote to its dead-letter topic, oldest
/// first per partition, calls `seen` with each selected one not replayed or discarded
/// before, and replays or discards it if `action` says so. Returns how many were selected.
pub async fn pass(
    source: &KafkaConfig,
    pipeline: &PipelineConfig,
    selection: &Selection,
    action: Action,
    seen: impl FnMut(&DeadLetter),
) -> Result<u64, KafkaError> {
    let stored = {
        let source = source.clone();
        let client = format!("idem dlq {}", pipeline.name);
        tokio::task::spawn_blocking(move || read_all(&source, &client))
            .await
            .map_err(|error| KafkaError::Client(error.to_string()))??
    };
    let settled: BTreeSet<String> = stored
        .iter()
        .filter(|record| record.header(headers::PIPELINE).as_deref() == Some(&pipeline.name))
        .filter_map(|record| record.header(headers::SETTLED))
        .collect();
    let producer: FutureProducer =
        connect::producer(source, &format!("idem dlq {}", pipeline.name))
            .create()
            .map_err(|error| KafkaError::Client(error.to_string()))?;
    let mut walk = Walk::new(selection, seen);
    for record in &stored {
        if walk.is_done() {
            break;
        }
        let ours = record.header(headers::PIPELINE).as_deref() == Some(&pipeline.name);
        if !ours || record.header(headers::SETTLED).is_some() || settled.contains(&record.id()) {
            continue;
        }
        let Some(letter) = walk.meet(record.id(), message(source, pipeline, record)) else {
            continue;
        };
        match action {
            Action::Look => {}
            Action::Replay => {
                replay(&producer, source, record, letter.replays + 1).await?;
                mark(&producer, source, pipeline, record, "replayed").await?;
            }
            Action::Discard => mark(&producer, source, pipeline, record, "discarded").await?,
        }
    }
    Ok(walk.selected())
}

/// Every record of the dead-letter topic up to its end when the pass began (blocking),
/// oldest first per partition; at most [`SCAN_MESSAGES`].
fn read_all(source: &KafkaConfig, client: &str) -> Result<Vec<Stored>, KafkaError> {
    let reader = reader(source, client)?;
    let topic = &source.dead_letter_topic;
    let Some(count) = partitions(&reader, source, std::slice::from_ref(topic))?
        .get(topic)
        .copied()
    else {
        // `idem run` creates it; nothing was dead-lettered yet.
        return Ok(Vec::new());
    };
    let mut list = TopicPartitionList::new();
    for partition in 0..count {
        let partition = i32::try_from(partition).unwrap_or(i32::MAX);
        list.add_partition_offset(topic, partition, Offset::Beginning)
            .map_err(|error| KafkaError::Client(error.to_string()))?;
    }
    reader
        .assign(&list)
        .map_err(|error| failed(&reader, source, &error))?;
    read_until_ends(&reader, source, count)
}

/// Polls `reader` until each of the `count` partitions reached its end.
fn read_until_ends(
    reader: &Reader,
    source: &KafkaConfig,
    count: usize,
) -> Result<Vec<Stored>, KafkaError> {
    let mut ended = BTreeSet::new();
    let mut stored = Vec::new();
    let started = Instant::now();
    while ended.len() < count {
        if started.elapsed() > READ_FOR || stored.len() as u64 >= SCAN_MESSAGES {
            tracing::warn!(topic = %source.dead_letter_topic, read = stored.len(), "The dead-letter pass stopped before the topic's end; narrow it with --kind, --reason or --since, or replay what it found first.");
            break;
        }
        match reader.poll(REQUEST_TIMEOUT) {
            Some(Ok(record)) => stored.push(Stored {
                partition: record.partition(),
                offset: record.offset(),
                key: record.key().map(<[u8]>::to_vec),
                payload: record.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                headers: record
                    .headers()
                    .map(|headers| {
                        headers
                            .iter()
                            .map(|header| {
                                (header.key.to_string(), header.value.map(<[u8]>::to_vec))
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            }),
            Some(Err(ClientError::PartitionEOF(partition))) => {
                ended.insert(partition);
            }
            Some(Err(error)) => return Err(failed(reader, source, &error)),
            None => {}
        }
    }
    Ok(stored)
}

/// The dead letter as the pipeline's plugin saw it.
fn message(source: &KafkaConfig, pipeline: &PipelineConfig, record: &Stored) -> InboundMessage {
    let topic = record
        .header(headers::TOPIC)
        .unwrap_or_else(|| source.topics[0].clone());
    InboundMessage {
        pipeline: pipeline.name.clone(),
        source: KIND.to_string(),
        queue: topic.clone(),
        subject: topic,
        body: record.payload.clone(),
        headers: record
            .headers
            .iter()
            .map(|(name, value)| {
                let value = value.as_deref().map(String::from_utf8_lossy);
                (name.clone(), value.unwrap_or_default().into_owned())
            })
            .collect(),
        message_id: None,
        redelivered: false,
        delivery_count: None,
        attributes: Vec::new(),
    }
}

/// Produces the dead letter back to the topic it was consumed from: its key, its value, the
/// producer's headers (not the host's diagnostics) and the replay counted.
async fn replay(
    producer: &FutureProducer,
    source: &KafkaConfig,
    record: &Stored,
    replays: u64,
) -> Result<(), KafkaError> {
    let topic = record
        .header(headers::TOPIC)
        .filter(|topic| source.topics.contains(topic))
        .unwrap_or_else(|| source.topics[0].clone());
    let mut copied = OwnedHeaders::new();
    for (name, value) in &record.headers {
        if !headers::is_diagnostic(name) {
            copied = copied.insert(Header {
                key: name,
                value: value.as_deref(),
            });
        }
    }
    let replays = replays.to_string();
    copied = copied.insert(Header {
        key: headers::REPLAYS,
        value: Some(replays.as_bytes()),
    });
    let mut copy = FutureRecord::to(&topic)
        .payload(&record.payload)
        .headers(copied);
    if let Some(key) = &record.key {
        copy = copy.key(key);
    }
    producer
        .send(copy, REQUEST_TIMEOUT)
        .await
        .map(|_| ())
        .map_err(|(error, _)| KafkaError::Request {
            action: "replay to",
            name: topic,
            reason: error.to_string(),
        })
}

/// Appends the marker saying `record` was `what` (replayed, discarded).
async fn mark(
    producer: &FutureProducer,
    source: &KafkaConfig,
    pipeline: &PipelineConfig,
    record: &Stored,
    what: &str,
) -> Result<(), KafkaError> {
    let id = record.id();
    let marker: HashMap<&str, &str> = HashMap::from([
        (headers::SETTLED, id.as_str()),
        (headers::PIPELINE, pipeline.name.as_str()),
        (headers::REASON, what),
    ]);
    let mut marked = OwnedHeaders::new();
    for (name, value) in &marker {
        marked = marked.insert(Header {
            key: name,
            value: Some(value.as_bytes()),
        });
    }
    let record = FutureRecord::<(), [u8]>::to(&source.dead_letter_topic)
        .payload(&[])
        .headers(marked);
    producer
        .send(record, REQUEST_TIMEOUT)
        .await
        .map(|_| ())
        .map_err(|(error, _)| KafkaError::Request {
            action: "mark a dead letter on",
            name: source.dead_letter_topic.clone(),
            reason: error.to_string(),
        })
}
