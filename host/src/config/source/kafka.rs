//! An Apache Kafka source: `[pipelines.<name>.source]` with `kind = "kafka"` (being built,
//! issue 44; not a kind the config accepts yet).

use schemars::JsonSchema;
use serde::Deserialize;

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
