//! Where each consumer resumes in a log it reads by offset (a Kafka topic's partitions):
//! `idem_offsets`, per consumer, topic and partition, the offset below which every message is
//! settled, recorded as the source commits it to the broker. The broker's own record of it
//! (the group's committed offsets) can expire, be reset, or belong to a group renamed since;
//! the claims that make a repeat a duplicate are kept only for the claim window. This one
//! stays beside the claims, so a log is not read again from before what they still know.

use std::collections::BTreeMap;

use sqlx::PgPool;

use crate::store::bookkeeping;
use crate::store::tables::Tables;

/// A topic's partition, and the offset to resume it from.
pub type Floor = ((String, i32), i64);

/// One consumer's resume offsets, in the database its claims are in.
#[derive(Clone)]
pub struct Offsets {
    pool: PgPool,
    tables: Tables,
    consumer: String,
}

impl Offsets {
    pub fn new(pool: PgPool, tables: Tables, consumer: &str) -> Offsets {
        Offsets {
            pool,
            tables,
            consumer: consumer.to_string(),
        }
    }

    /// The consumer whose offsets these are.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Every partition of `topics` the consumer recorded, with its offset.
    pub async fn read(
        &self,
        topics: &[String],
    ) -> Result<BTreeMap<(String, i32), i64>, sqlx::Error> {
        let rows: Vec<(String, i32, i64)> =
            bookkeeping::in_transaction(&self.pool, async |connection| {
                bookkeeping::query_as(&self.tables.sql(
                    "SELECT topic, partition, next_offset FROM {offsets} \
                     WHERE consumer = $1 AND topic = ANY($2)",
                ))
                .bind(&self.consumer)
                .bind(topics)
                .fetch_all(connection)
                .await
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|(topic, partition, offset)| ((topic, partition), offset))
            .collect())
    }

    /// Records `floors`: each replaces what its partition had. Never the greater of the two:
    /// a topic deleted and created again starts its offsets anew, and a floor kept from the
    /// old one would skip the new one's messages.
    pub async fn record(&self, floors: &[Floor]) -> Result<(), sqlx::Error> {
        let topics: Vec<&str> = floors
            .iter()
            .map(|((topic, _), _)| topic.as_str())
            .collect();
        let partitions: Vec<i32> = floors
            .iter()
            .map(|((_, partition), _)| *partition)
            .collect();
        let offsets: Vec<i64> = floors.iter().map(|(_, offset)| *offset).collect();
        bookkeeping::in_transaction(&self.pool, async |connection| {
            bookkeeping::query(&self.tables.sql(
                "INSERT INTO {offsets} (consumer, topic, partition, next_offset) \
                 SELECT $1, floor.topic, floor.partition, floor.next_offset \
                 FROM unnest($2::text[], $3::int4[], $4::int8[]) \
                   AS floor(topic, partition, next_offset) \
                 ON CONFLICT (consumer, topic, partition) DO UPDATE \
                   SET next_offset = EXCLUDED.next_offset, recorded_at = now()",
            ))
            .bind(&self.consumer)
            .bind(&topics)
            .bind(&partitions)
            .bind(&offsets)
            .execute(connection)
            .await
        })
        .await
        .map(drop)
    }
}
