//! Where an assigned partition resumes: the group's committed offset, else where `start`
//! says (the offset of `now − claim window`, the earliest or the end), and never below the
//! floor this consumer recorded in the database (`store::offsets`).
//!
//! The group's offsets are the broker's: they expire (`offsets.retention.minutes`), an
//! operator resets them, a renamed group has none. The claims that make a repeat a duplicate
//! are kept only for the claim window. So the poll thread records each floor it commits in
//! the database too, beside the claims, and a partition whose group start is below the
//! recorded floor resumes at the floor: nothing the consumer settled is read again, however
//! old. A recorded floor past the partition's end means the topic is not the one it was
//! recorded for (deleted and created again): it is ignored, loudly, rather than skipping the
//! new topic's messages.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::backoff::Backoff;
use crate::config::KafkaStart;
use crate::store::offsets::{Floor, Offsets};

use super::offsets::Partition;

/// How long the recorder gathers commits into one write.
const RECORD_EVERY: Duration = Duration::from_secs(1);
/// How long a request to the broker (committed offsets, a time lookup, a watermark) may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long closing waits for the last floors to be recorded.
const LAST_RECORD: Duration = Duration::from_secs(5);

/// One source's starts, and its floors on their way to the database.
pub struct Resume {
    pipeline: String,
    start: KafkaStart,
    /// How far back a group without a committed offset starts (`start = "window"`).
    window: Option<Duration>,
    offsets: Offsets,
    /// The floors in the database, as read at opening and recorded since.
    recorded: Mutex<BTreeMap<Partition, i64>>,
    /// Floors committed and not recorded yet.
    pending: Mutex<BTreeMap<Partition, i64>>,
    wake: tokio::sync::Notify,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Resume {
    /// Reads the consumer's recorded floors of `topics`, waiting for the database (and saying
    /// so) while it is unreachable (the consume loop drops the wait at shutdown).
    pub async fn read(
        pipeline: &str,
        start: KafkaStart,
        window: Option<Duration>,
        offsets: Offsets,
        topics: &[String],
    ) -> Resume {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        let recorded = loop {
            match offsets.read(topics).await {
                Ok(recorded) => break recorded,
                Err(error) => {
                    let delay = backoff.next_delay();
                    warn!(%pipeline, %error, retry_in_ms = delay.as_millis() as u64, "PostgreSQL unavailable: cannot read where the consumer resumes (idem_offsets); retrying before joining the group.");
                    tokio::time::sleep(delay).await;
                }
            }
        };
        let recorded = recorded
            .into_iter()
            .map(|((topic, partition), offset)| (Partition::new(topic, partition), offset))
            .collect();
        Resume {
            pipeline: pipeline.to_string(),
            start,
            window,
            offsets,
            recorded: Mutex::new(recorded),
            pending: Mutex::new(BTreeMap::new()),
            wake: tokio::sync::Notify::new(),
        }
    }

    /// Where each partition of `partitions` starts (see the module's documentation).
    pub fn starts<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        partitions: &TopicPartitionList,
    ) -> BTreeMap<Partition, Offset> {
        let committed = consumer
            .committed_offsets(partitions.clone(), ASK_TIMEOUT)
            .unwrap_or_else(|error| {
                warn!(pipeline = %self.pipeline, %error, "Cannot read the group's committed offsets; starting where `start` says.");
                partitions.clone()
            });
        let mut starts = BTreeMap::new();
        let mut fresh = Vec::new();
        for element in committed.elements() {
            let partition = Partition::new(element.topic(), element.partition());
            match element.offset() {
                Offset::Offset(offset) if offset >= 0 => {
                    starts.insert(partition, Offset::Offset(offset));
                }
                _ => {
                    starts.insert(partition.clone(), self.fallback());
                    fresh.push(partition);
                }
            }
        }
        self.window_starts(consumer, &fresh, &mut starts);
        for (partition, start) in &mut starts {
            self.raise(consumer, partition, start);
        }
        starts
    }

    /// With `start = "window"`: partitions of a group without committed offsets start at the
    /// offset of `now − claim window`.
    fn window_starts<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        fresh: &[Partition],
        starts: &mut BTreeMap<Partition, Offset>,
    ) {
        let (Some(window), KafkaStart::Window) = (self.window, self.start) else {
            return;
        };
        if fresh.is_empty() {
            return;
        }
        let since = SystemTime::now()
            .checked_sub(window)
            .and_then(|since| since.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |since| {
                i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
            });
        let mut asked = TopicPartitionList::new();
        for partition in fresh {
            let _ = asked.add_partition_offset(
                &partition.topic,
                partition.partition,
                Offset::Offset(since),
            );
        }
        match consumer.offsets_for_times(asked, ASK_TIMEOUT) {
            Ok(found) => {
                for element in found.elements() {
                    let partition = Partition::new(element.topic(), element.partition());
                    if !fresh.contains(&partition) {
                        continue;
                    }
                    // Nothing as recent: the end (only what is produced from now on).
                    let start = match element.offset() {
                        Offset::Offset(offset) if offset >= 0 => Offset::Offset(offset),
                        _ => Offset::End,
                    };
                    starts.insert(partition, start);
                }
            }
            Err(error) => {
                warn!(pipeline = %self.pipeline, %error, "Cannot find the claim window's first offsets; a new group starts at the earliest.");
            }
        }
    }

    /// Where a partition without a committed offset starts when no time lookup decides.
    fn fallback(&self) -> Offset {
        match self.start {
            KafkaStart::Latest => Offset::End,
            KafkaStart::Window | KafkaStart::Earliest => Offset::Beginning,
        }
    }

    /// Moves `start` up to `partition`'s recorded floor when it is below it and the floor is
    /// within the partition.
    fn raise<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        partition: &Partition,
        start: &mut Offset,
    ) {
        let Some(floor) = locked(&self.recorded).get(partition).copied() else {
            return;
        };
        let below = match *start {
            Offset::Offset(offset) => offset < floor,
            Offset::Beginning => true,
            _ => false,
        };
        if !below {
            return;
        }
        let pipeline = &self.pipeline;
        match consumer.fetch_watermarks(&partition.topic, partition.partition, ASK_TIMEOUT) {
            Ok((_, high)) if floor <= high => {
                info!(%pipeline, %partition, from = ?start, floor, "The group's start is below what this consumer settled (its offsets expired, were reset, or the group is new): resuming at the floor recorded in idem_offsets.");
                *start = Offset::Offset(floor);
            }
            Ok((_, high)) => {
                warn!(%pipeline, %partition, floor, end = high, "The floor recorded in idem_offsets is past the partition's end: the topic was deleted and created again? Starting where the group says; the claims make repeats within the claim window duplicates.");
            }
            Err(error) => {
                warn!(%pipeline, %partition, floor, %error, "Cannot read the partition's end to check the floor recorded in idem_offsets; starting where the group says.");
            }
        }
    }

    /// Floors the poll thread committed (or is committing): recorded within about a second.
    pub fn committed(&self, floors: &[(Partition, i64)]) {
        if floors.is_empty() {
            return;
        }
        let mut pending = locked(&self.pending);
        for (partition, offset) in floors {
            pending.insert(partition.clone(), *offset);
        }
        drop(pending);
        self.wake.notify_one();
    }

    /// Records committed floors until `closed`, a write about every second.
    pub async fn record(&self, closed: &CancellationToken) {
        let mut backoff = Backoff::new(RECORD_EVERY, Duration::from_secs(30));
        loop {
            tokio::select! {
                () = self.wake.notified() => {}
                () = closed.cancelled() => return,
            }
            tokio::select! {
                () = tokio::time::sleep(RECORD_EVERY) => {}
                () = closed.cancelled() => return,
            }
            match self.write().await {
                Ok(()) => backoff.reset(),
                Err(error) => {
                    let delay = backoff.next_delay();
                    warn!(pipeline = %self.pipeline, %error, retry_in_ms = delay.as_millis() as u64, "Cannot record the committed offsets in idem_offsets; retrying (the group's own offsets are committed).");
                    self.wake.notify_one();
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = closed.cancelled() => return,
                    }
                }
            }
        }
    }

    /// Records what is pending before the source closes, waiting at most `LAST_RECORD`.
    pub async fn record_last(&self) {
        match tokio::time::timeout(LAST_RECORD, self.write()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                warn!(pipeline = %self.pipeline, %error, "Cannot record the last committed offsets in idem_offsets (the group's own offsets are committed).");
            }
            Err(_) => {
                warn!(pipeline = %self.pipeline, "Recording the last committed offsets in idem_offsets timed out (the group's own offsets are committed).");
            }
        }
    }

    /// Writes what is pending; on failure it stays pending (unless committed anew since).
    async fn write(&self) -> Result<(), sqlx::Error> {
        let pending = std::mem::take(&mut *locked(&self.pending));
        if pending.is_empty() {
            return Ok(());
        }
        let floors: Vec<Floor> = pending
            .iter()
            .map(|(partition, offset)| ((partition.topic.clone(), partition.partition), *offset))
            .collect();
        match self.offsets.record(&floors).await {
            Ok(()) => {
                locked(&self.recorded).extend(pending);
                Ok(())
            }
            Err(error) => {
                let mut again = locked(&self.pending);
                for (partition, offset) in pending {
                    again.entry(partition).or_insert(offset);
                }
                Err(error)
            }
        }
    }
}
