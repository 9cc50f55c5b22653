//! The soak's Kafka pipeline: a tansu broker of the soak's own with a topic of
//! [`PARTITIONS`] partitions, every order produced to it keyed by its customer, served by both
//! hosts in one consumer group (and by a third member the nemesis brings in and takes out);
//! and what the checker reads back from the broker: where each partition ends, what the
//! group committed, the dead-letter topic.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use idem_host::source::headers;

use crate::kafka::Tansu;

/// The topic's partitions: more than the hosts, so a rebalance moves some and keeps some.
pub(super) const PARTITIONS: i32 = 4;

/// The pipeline's name and consumer.
pub(super) const PIPELINE: &str = "kafka";

/// Its consumer group at first: the default for a pipeline named [`PIPELINE`].
const GROUP: &str = "idem-kafka";

/// The Kafka pipeline's own ledger and balances; `applied` counts the order rows commit in
/// (one key's rows commit one at a time under `ordering = "key"`).
pub(super) const TABLES: &str = "CREATE TABLE kafka_ledger (customer_id bigint NOT NULL, order_id bigint NOT NULL, points bigint NOT NULL, applied bigint GENERATED ALWAYS AS IDENTITY); \
     CREATE TABLE kafka_balances (customer_id bigint PRIMARY KEY, points bigint NOT NULL)";

pub(super) struct SoakTopic {
    broker: Tansu,
    /// The group the hosts are in: [`GROUP`], or the one they moved to after tansu stalled
    /// the first (see [`SoakTopic::regroup`]).
    group: Mutex<String>,
    pub(super) topic: String,
    dead_letter_topic: String,
}

impl SoakTopic {
    /// A broker of the soak's own and `topic` on it.
    pub(super) async fn start(topic: &str) -> SoakTopic {
        let broker = Tansu::start();
        broker.create_topic(topic, PARTITIONS).await;
        SoakTopic {
            broker,
            group: Mutex::new(GROUP.to_string()),
            topic: topic.to_string(),
            dead_letter_topic: format!("{topic}.dead-letter"),
        }
    }

    /// The `[pipelines.kafka]` table: the loyalty plugin on the topic, ledger claims, ordering
    /// by key (the default), batches of 16. A member that stops heartbeating is out of the
    /// group after 6 s, so a killed host's partitions move within the run.
    pub(super) fn pipeline_table(&self, plugin: &Path) -> String {
        format!(
            r#"
[pipelines.{PIPELINE}]
consumer = "{PIPELINE}"
plugin = "{plugin}"
max_attempts = 3
workers = 6

[pipelines.{PIPELINE}.batch]
size = 16

[pipelines.{PIPELINE}.source]
kind = "kafka"
brokers = ["{brokers}"]
topic = "{topic}"
properties = {{ "session.timeout.ms" = 6000, "heartbeat.interval.ms" = 500 }}

[pipelines.{PIPELINE}.statements]
record_ledger = "INSERT INTO kafka_ledger (customer_id, order_id, points) VALUES ($1, $2, $3)"
credit_balance = """
INSERT INTO kafka_balances (customer_id, points) VALUES ($1, $2)
ON CONFLICT (customer_id) DO UPDATE SET points = kafka_balances.points + EXCLUDED.points
"""
"#,
            plugin = plugin.display(),
            brokers = self.broker.brokers(),
            topic = self.topic,
        )
    }

    /// Produces `body` keyed by `customer` (so one customer's orders share a partition, in
    /// the order produced) with `headers`. Waits for the broker's ack.
    pub(super) async fn produce(&self, customer: i64, body: &[u8], headers: &[(&str, &str)]) {
        let key = format!("customer-{customer}");
        self.broker
            .produce(&self.topic, Some(&key), body, headers)
            .await;
    }

    /// Per partition, the records the group has not committed past: where it `ends` less
    /// the group's committed offset (a partition with no commit counts from 0).
    pub(super) fn uncommitted(&self, ends: &BTreeMap<i32, i64>) -> BTreeMap<i32, i64> {
        let group = self.group.lock().expect("group").clone();
        let committed = self.broker.committed(&self.topic, &group, PARTITIONS);
        (0..PARTITIONS)
            .map(|partition| {
                let end = ends.get(&partition).copied().unwrap_or(0);
                let at = committed.get(&partition).copied().unwrap_or(0);
                (partition, end - at)
            })
            .collect()
    }

    /// A new group for the hosts, after tansu's coordinator stalled theirs: it keeps a dead
    /// member as the group's leader for good, answering every SyncGroup "rebalance in
    /// progress" (librdkafka's `debug = "cgrp"` shows the same LeaderId generation after
    /// generation), where a Kafka broker would evict the member after `session.timeout.ms`.
    /// The new group has no offsets of its own: the database floor (`idem_offsets`) is where
    /// it starts. Returns the group's name.
    pub(super) fn regroup(&self) -> String {
        let mut group = self.group.lock().expect("group");
        *group = format!("{GROUP}-{}", crate::free_port());
        group.clone()
    }

    /// Where each partition ends now (the offset after its last record).
    pub(super) fn ends(&self) -> BTreeMap<i32, i64> {
        self.broker.ends(&self.topic)
    }

    /// The body of every dead letter on the dead-letter topic (a replayed dead letter that
    /// failed again is there twice: a Kafka topic keeps every record), leaving out the markers
    /// `idem dlq replay` and `discard` append (`x-idem-settled`) to say which they settled.
    pub(super) fn dead_letters(&self) -> Vec<Vec<u8>> {
        self.broker
            .read_all(&self.dead_letter_topic)
            .into_iter()
            .filter(|record| record.header(headers::SETTLED).is_none())
            .map(|record| record.payload)
            .collect()
    }
}
