//! What waits for a Kafka pipeline: per partition, the end offset less the group's committed
//! offset (or the earliest, before the group committed any), and the dead-letter topic's
//! messages. Read outside the group's membership, so looking moves nothing.

use std::collections::BTreeMap;

use rdkafka::consumer::Consumer;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::KafkaConfig;
use crate::source::Depths;

use super::topology::{REQUEST_TIMEOUT, Reader, failed, partitions, reader};
use super::{KafkaError, offsets::Partition};

/// What a Kafka source holds, as its brokers say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    /// The consumed topics' partitions, each with its messages not committed by the group.
    pub waiting: BTreeMap<Partition, u64>,
    /// Messages on the dead-letter topic (`None`: it does not exist yet).
    pub dead_letters: Option<u64>,
    /// Whether the group committed an offset on any partition.
    pub committed: bool,
    /// Consumed topics the cluster does not have.
    pub missing: Vec<String>,
}

/// Looks at `source`'s topics and its group's offsets (blocking).
pub fn inspect(reader: &Reader, source: &KafkaConfig) -> Result<Found, KafkaError> {
    let mut wanted = source.topics.clone();
    wanted.push(source.dead_letter_topic.clone());
    let counts = partitions(reader, source, &wanted)?;
    let mut found = Found {
        missing: source
            .topics
            .iter()
            .filter(|topic| !counts.contains_key(*topic))
            .cloned()
            .collect(),
        ..Found::default()
    };
    let mut list = TopicPartitionList::new();
    for topic in &source.topics {
        for partition in 0..counts.get(topic).copied().unwrap_or(0) {
            list.add_partition(topic, i32::try_from(partition).unwrap_or(i32::MAX));
        }
    }
    let committed = reader
        .committed_offsets(list.clone(), REQUEST_TIMEOUT)
        .map_err(|error| failed(reader, source, &error))?;
    for element in committed.elements() {
        let (low, high) = reader
            .fetch_watermarks(element.topic(), element.partition(), REQUEST_TIMEOUT)
            .map_err(|error| failed(reader, source, &error))?;
        let from = match element.offset() {
            Offset::Offset(offset) if offset >= 0 => {
                found.committed = true;
                offset.max(low)
            }
            _ => low,
        };
        let partition = Partition::new(element.topic(), element.partition());
        found
            .waiting
            .insert(partition, u64::try_from(high - from).unwrap_or(0));
    }
    if let Some(count) = counts.get(&source.dead_letter_topic) {
        let mut total = 0;
        for partition in 0..*count {
            let partition = i32::try_from(partition).unwrap_or(i32::MAX);
            let (low, high) = reader
                .fetch_watermarks(&source.dead_letter_topic, partition, REQUEST_TIMEOUT)
                .map_err(|error| failed(reader, source, &error))?;
            total += u64::try_from(high - low).unwrap_or(0);
        }
        found.dead_letters = Some(total);
    }
    Ok(found)
}

/// The depths of `source` for the sampled gauges, over `kept`, a reader opened on first use
/// and again after a failure.
pub async fn depths(
    kept: &mut Option<std::sync::Arc<Reader>>,
    source: &KafkaConfig,
) -> Result<Depths, KafkaError> {
    let client = match kept {
        Some(client) => std::sync::Arc::clone(client),
        None => {
            let client = std::sync::Arc::new(reader(source, "idem depths")?);
            *kept = Some(std::sync::Arc::clone(&client));
            client
        }
    };
    let looked = {
        let source = source.clone();
        tokio::task::spawn_blocking(move || inspect(&client, &source))
            .await
            .map_err(|error| KafkaError::Client(error.to_string()))?
    };
    let found = match looked {
        Ok(found) => found,
        Err(error) => {
            *kept = None;
            return Err(error);
        }
    };
    Ok(Depths {
        waiting: found.waiting.values().sum(),
        unacknowledged: None,
        dead_letters: found.dead_letters,
        oldest_age: None,
        partitions: found
            .waiting
            .into_iter()
            .map(|(partition, waiting)| ((partition.topic, partition.partition), waiting))
            .collect(),
    })
}
