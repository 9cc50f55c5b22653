//! Small Kafka chores for `bench/throughput.sh`, the counterpart of `streams` for JetStream:
//!
//! ```text
//! topics depth TOPIC GROUP   print the records of TOPIC that GROUP has not committed
//! topics count TOPIC         print the records in TOPIC (0 if it does not exist)
//! ```
//!
//! Both read the records (to each partition's end) rather than trust the broker's high
//! watermark: the test broker's (tansu's) is its last batch's base offset + 1, short of the
//! end. `KAFKA_BROKERS` overrides `127.0.0.1:9092`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

fn fail(message: String) -> ! {
    eprintln!("topics: {message}");
    std::process::exit(1)
}

fn main() {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let count = match arguments
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["depth", topic, group] => remaining(&brokers, topic, Some(group)),
        ["count", topic] => remaining(&brokers, topic, None),
        _ => fail("usage: topics depth TOPIC GROUP | topics count TOPIC".to_string()),
    };
    println!("{count}");
}

/// The records of `topic` from `group`'s committed offsets (from the beginning without a
/// group, or where it committed nothing) to each partition's end.
fn remaining(brokers: &str, topic: &str, group: Option<&str>) -> u64 {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group.unwrap_or("topics-count"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .create()
        .unwrap_or_else(|error| fail(format!("a Kafka client for {brokers}: {error}")));
    let timeout = Duration::from_secs(10);
    let metadata = reader
        .fetch_metadata(Some(topic), timeout)
        .unwrap_or_else(|error| fail(format!("the metadata of {topic:?}: {error}")));
    let partitions = metadata
        .topics()
        .first()
        .map_or(0, |topic| topic.partitions().len());
    if partitions == 0 {
        return 0;
    }
    let mut list = TopicPartitionList::new();
    for partition in 0..partitions {
        let partition = i32::try_from(partition).unwrap_or(i32::MAX);
        list.add_partition_offset(topic, partition, Offset::Beginning)
            .unwrap_or_else(|error| fail(format!("partition {partition}: {error}")));
    }
    if group.is_some() {
        let committed = reader
            .committed_offsets(list.clone(), timeout)
            .unwrap_or_else(|error| fail(format!("{group:?}'s committed offsets: {error}")));
        for element in committed.elements() {
            if let Offset::Offset(offset) = element.offset()
                && offset >= 0
            {
                list.set_partition_offset(topic, element.partition(), Offset::Offset(offset))
                    .unwrap_or_else(|error| fail(format!("partition offset: {error}")));
            }
        }
    }
    reader
        .assign(&list)
        .unwrap_or_else(|error| fail(format!("assign {topic:?}: {error}")));
    let mut ended = BTreeSet::new();
    let mut records = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ended.len() < partitions {
        if Instant::now() > deadline {
            fail(format!("{topic:?} was not read to its end within 60 s"));
        }
        match reader.poll(Duration::from_millis(500)) {
            Some(Ok(_)) => records += 1,
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(partition))) => {
                ended.insert(partition);
            }
            Some(Err(error)) => fail(format!("reading {topic:?}: {error}")),
            None => {}
        }
    }
    records
}
