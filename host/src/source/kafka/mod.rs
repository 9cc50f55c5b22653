//! An Apache Kafka source (being built, issue 44): a topic's partitions read by one consumer
//! of a group, exactly once into PostgreSQL by the claim. This step holds the two decisions
//! the consumer makes without the broker: where a partition resumes (`offsets`) and the
//! order messages are handed out in (`lanes`).

pub mod lanes;
pub mod offsets;
