//! The one thread that owns a pipeline's librdkafka consumer and never stops polling while
//! the source is open: it serves rebalances (and `max.poll.interval.ms`) while every worker
//! is busy, puts each message received in its lane, pauses a partition whose messages in
//! flight reach `in_flight_per_partition` (resumed at half), and commits each partition's
//! settled floor about once a second (synchronously at a revoke and at close).
//!
//! A revoke drops the revoked partitions' messages not handed out, waits (at most
//! `revoke_timeout`) for their transactions in flight, commits their floors, then lets them
//! go. A lost assignment commits nothing; late settlements of it are refused by their epoch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError as ClientError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::KafkaConfig;

use super::lanes::{Lane, Lanes};
use super::offsets::{Floors, Partition};
use super::resume::Resume;
use super::{KIND, KafkaError};
use crate::message::InboundMessage;
use crate::source::standing::Standing;

/// A message received and not settled: what the plugin sees, and where it came from.
#[derive(Debug, Clone)]
pub struct Held {
    pub partition: Partition,
    pub epoch: u64,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    /// The headers as produced (a dead letter copies them byte for byte).
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// The plugin's try this is (1 at first, more after retries).
    pub attempt: u32,
    /// What the plugin sees: the value is its body.
    pub message: InboundMessage,
}

impl Held {
    /// `self` as try `attempt`.
    pub fn on_try(mut self, attempt: u32) -> Held {
        self.attempt = attempt;
        self.message.redelivered = attempt > 1;
        self
    }
}

/// What the poll thread, the deliveries and `next` share.
#[derive(Default)]
pub struct State {
    pub floors: Floors,
    pub lanes: Lanes<Held>,
    /// Messages handed out and not settled, by partition (their transactions in flight).
    pub out: BTreeMap<Partition, usize>,
    paused: BTreeSet<Partition>,
    /// Why the source cannot go on (a refusal): `next` returns it.
    pub failure: Option<KafkaError>,
    /// The source is closing: the poll thread commits and leaves the group.
    pub closing: bool,
    /// Why the brokers cannot be reached, since librdkafka said all were down and until
    /// one answers again.
    pub unreachable: Option<String>,
}

/// The state behind one lock, and the two ways to wait on it.
pub struct Shared {
    pub state: Mutex<State>,
    /// Wakes `next`: a message is ready, or the source failed.
    pub ready: tokio::sync::Notify,
    /// Wakes a revoke waiting for the revoked partitions' transactions.
    pub settled: Condvar,
    pub pipeline: String,
    pub source: KafkaConfig,
    /// Where assigned partitions start, and the floors recorded in the database.
    pub resume: Resume,
    /// How the source stands, for `/readyz` and the gauges.
    pub standing: Arc<Standing>,
    pub shutdown: CancellationToken,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A broker answered: they are not all down.
    fn reached(&self) {
        let mut state = self.lock();
        if state.unreachable.take().is_some() {
            drop(state);
            info!(pipeline = %self.pipeline, "Kafka reachable again.");
            self.stand();
        }
    }

    /// Tells the pipeline how the source stands: receiving nothing when the brokers are
    /// unreachable and no partition is assigned (with partitions assigned, what was fetched
    /// still applies, and the group keeps them until its session expires).
    fn stand(&self) {
        let state = self.lock();
        let problem = match &state.unreachable {
            Some(reason) if state.floors.partitions().next().is_none() => Some(format!(
                "no Kafka partition assigned: the brokers are unreachable ({reason})"
            )),
            _ => None,
        };
        drop(state);
        self.standing.set_problem(problem);
    }

    /// `held` back in `lane`, first of it, as try `attempt` (its offset stays open); `false`
    /// when its assignment is over.
    pub fn put_back(&self, lane: &Lane, held: &Held, attempt: u32) -> bool {
        let mut state = self.lock();
        if state.floors.epoch(&held.partition) != Some(held.epoch) {
            return false;
        }
        state
            .lanes
            .again(lane.clone(), held.clone().on_try(attempt));
        drop(state);
        self.ready.notify_one();
        true
    }
}

impl State {
    /// A message handed out is done with (settled, or set aside): one fewer in flight.
    pub fn returned(&mut self, partition: &Partition) {
        if let Some(out) = self.out.get_mut(partition) {
            *out = out.saturating_sub(1);
        }
    }
}

/// The consumer's context: rebalances, errors and librdkafka's log lines, served on the poll
/// thread.
pub struct Context {
    pub shared: Arc<Shared>,
}

impl ClientContext for Context {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, line: &str) {
        use rdkafka::config::RDKafkaLogLevel as Level;
        let pipeline = &self.shared.pipeline;
        match level {
            Level::Emerg | Level::Alert | Level::Critical | Level::Error | Level::Warning => {
                warn!(%pipeline, facility, "librdkafka: {line}");
            }
            _ => debug!(%pipeline, facility, "librdkafka: {line}"),
        }
    }

    fn error(&self, error: ClientError, reason: &str) {
        let pipeline = &self.shared.pipeline;
        if let Some(refused) = KafkaError::refused(&self.shared.source.table, &error, Some(reason))
        {
            warn!(%pipeline, error = %refused, "Kafka refused the consumer.");
            self.shared.lock().failure = Some(refused);
            self.shared.ready.notify_one();
            return;
        }
        warn!(%pipeline, %error, reason, "Kafka unavailable; librdkafka keeps reconnecting.");
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) {
            self.shared.lock().unreachable = Some(reason.to_string());
            self.shared.stand();
        }
    }
}

impl ConsumerContext for Context {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        event: RDKafkaRespErr,
        partitions: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let outcome = match event {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                self.assign(consumer, partitions, cooperative)
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.revoke(consumer, partitions, cooperative)
            }
            other => {
                warn!(pipeline = %self.shared.pipeline, error = ?other, "Kafka rebalance failed; giving up the assignment.");
                self.release(partitions);
                consumer.unassign()
            }
        };
        self.shared.standing.rebalanced();
        self.shared.stand();
        if let Err(error) = outcome {
            warn!(pipeline = %self.shared.pipeline, %error, "Kafka rebalance step failed.");
        }
    }

    fn commit_callback(
        &self,
        result: rdkafka::error::KafkaResult<()>,
        offsets: &TopicPartitionList,
    ) {
        match result {
            Ok(()) => {
                let mut state = self.shared.lock();
                for element in offsets.elements() {
                    if let Offset::Offset(offset) = element.offset() {
                        let partition = Partition::new(element.topic(), element.partition());
                        state.floors.committed(&partition, offset);
                    }
                }
            }
            Err(error) => {
                debug!(pipeline = %self.shared.pipeline, %error, "A Kafka commit failed; the next one carries the floor.");
            }
        }
    }
}

impl Context {
    /// Starts each assigned partition at its committed offset (or where `start` says for a
    /// group that has none), then takes it.
    fn assign(
        &self,
        consumer: &BaseConsumer<Self>,
        partitions: &mut TopicPartitionList,
        cooperative: bool,
    ) -> rdkafka::error::KafkaResult<()> {
        let starts = self.shared.resume.starts(consumer, partitions);
        let mut state = self.shared.lock();
        for element in partitions.elements() {
            let partition = Partition::new(element.topic(), element.partition());
            let start = starts.get(&partition).copied().unwrap_or(Offset::Stored);
            // A logical start (the beginning, the end) is known once a message arrives.
            let known = match start {
                Offset::Offset(offset) => offset,
                _ => -1,
            };
            state.floors.assign(partition.clone(), known);
            state.out.remove(&partition);
        }
        drop(state);
        for (partition, start) in &starts {
            partitions.set_partition_offset(&partition.topic, partition.partition, *start)?;
        }
        info!(
            pipeline = %self.shared.pipeline,
            partitions = %describe(partitions),
            "Kafka assigned partitions."
        );
        if cooperative {
            consumer.incremental_assign(partitions)
        } else {
            consumer.assign(partitions)
        }
    }

    /// Gives up `partitions`: what was not handed out is dropped, the transactions in flight
    /// are waited for (a lost assignment waits for nothing and commits nothing), the floors
    /// are committed, then the partitions go.
    fn revoke(
        &self,
        consumer: &BaseConsumer<Self>,
        partitions: &TopicPartitionList,
        cooperative: bool,
    ) -> rdkafka::error::KafkaResult<()> {
        let lost = consumer.assignment_lost();
        let revoked: Vec<Partition> = partitions
            .elements()
            .iter()
            .map(|element| Partition::new(element.topic(), element.partition()))
            .collect();
        let mut state = self.shared.lock();
        for partition in &revoked {
            state.lanes.drop_partition(partition);
        }
        if !lost {
            let deadline = Instant::now() + self.shared.source.revoke_timeout;
            while revoked
                .iter()
                .any(|partition| state.out.get(partition).copied().unwrap_or(0) > 0)
            {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    warn!(pipeline = %self.shared.pipeline, "Kafka revoke: transactions still in flight after revoke_timeout; their partitions go, and what they apply after is a duplicate to the next owner.");
                    break;
                }
                state = self
                    .shared
                    .settled
                    .wait_timeout(state, left)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
        }
        let mut floors = TopicPartitionList::new();
        let mut released = Vec::new();
        for partition in &revoked {
            if let Some(floor) = state.floors.release(partition)
                && floor >= 0
            {
                floors.add_partition_offset(
                    &partition.topic,
                    partition.partition,
                    Offset::Offset(floor),
                )?;
                released.push((partition.clone(), floor));
            }
            state.out.remove(partition);
            state.paused.remove(partition);
        }
        drop(state);
        if lost {
            warn!(pipeline = %self.shared.pipeline, partitions = %describe(partitions), "Kafka assignment lost: nothing committed; late settlements are refused.");
        } else {
            self.shared.resume.committed(&released);
            if floors.count() > 0
                && let Err(error) = consumer.commit(&floors, CommitMode::Sync)
            {
                warn!(pipeline = %self.shared.pipeline, %error, "Cannot commit the revoked partitions' floors; their next owner reads from the last commit (the claims make repeats duplicates).");
            }
            info!(pipeline = %self.shared.pipeline, partitions = %describe(partitions), "Kafka revoked partitions.");
        }
        if cooperative {
            consumer.incremental_unassign(partitions)
        } else {
            consumer.unassign()
        }
    }

    fn release(&self, partitions: &TopicPartitionList) {
        let mut state = self.shared.lock();
        for element in partitions.elements() {
            let partition = Partition::new(element.topic(), element.partition());
            state.lanes.drop_partition(&partition);
            state.floors.release(&partition);
            state.out.remove(&partition);
        }
    }
}

/// `orders[0],orders[1]` for the logs.
fn describe(partitions: &TopicPartitionList) -> String {
    partitions
        .elements()
        .iter()
        .map(|element| format!("{}[{}]", element.topic(), element.partition()))
        .collect::<Vec<_>>()
        .join(",")
}

/// How often the thread commits the floors that moved.
const COMMIT_EVERY: Duration = Duration::from_secs(1);
/// How often it pauses and resumes partitions by their messages in flight.
const BALANCE_EVERY: Duration = Duration::from_millis(20);

/// Polls until the source closes, then commits the floors and leaves the group.
pub fn run(consumer: BaseConsumer<Context>, shared: Arc<Shared>) {
    let mut committed_at = Instant::now();
    let mut balanced_at = Instant::now();
    loop {
        if shared.lock().closing {
            break;
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(message)) => receive(&shared, &message),
            Some(Err(error)) => {
                if let Some(refused) = KafkaError::refused(&shared.source.table, &error, None) {
                    shared.lock().failure = Some(refused);
                    shared.ready.notify_one();
                } else {
                    warn!(pipeline = %shared.pipeline, %error, "Kafka consume error; polling on.");
                }
            }
            None => {}
        }
        if balanced_at.elapsed() >= BALANCE_EVERY {
            balanced_at = Instant::now();
            balance(&consumer, &shared);
        }
        if committed_at.elapsed() >= COMMIT_EVERY {
            committed_at = Instant::now();
            commit(&consumer, &shared, CommitMode::Async);
            look_for_brokers(&consumer, &shared);
        }
    }
    commit(&consumer, &shared, CommitMode::Sync);
    consumer.unsubscribe();
    // Dropping the consumer leaves the group (the revoke above runs first).
    drop(consumer);
}

/// While the brokers are unreachable, asks them for metadata (briefly: nothing else needs
/// the thread then) to learn when one answers again.
fn look_for_brokers(consumer: &BaseConsumer<Context>, shared: &Shared) {
    if shared.lock().unreachable.is_none() {
        return;
    }
    if consumer
        .fetch_metadata(None, Duration::from_millis(500))
        .is_ok()
    {
        shared.reached();
    } else {
        shared.stand();
    }
}

/// A message received: in its lane, its offset open until settled.
fn receive(shared: &Shared, message: &BorrowedMessage<'_>) {
    let partition = Partition::new(message.topic(), message.partition());
    let mut state = shared.lock();
    let Some(epoch) = state.floors.epoch(&partition) else {
        return;
    };
    if !state.floors.received(&partition, epoch, message.offset()) {
        return;
    }
    let held = held(shared, partition.clone(), epoch, message);
    let lane = Lane::of(
        shared.source.ordering,
        &partition,
        held.key.as_deref(),
        held.offset,
    );
    state.lanes.push(lane, held);
    drop(state);
    shared.ready.notify_one();
}

/// A message received in assignment `epoch`, as the plugin will see it.
fn held(shared: &Shared, partition: Partition, epoch: u64, message: &BorrowedMessage<'_>) -> Held {
    let headers: Vec<(String, Option<Vec<u8>>)> = message
        .headers()
        .map(|headers| {
            headers
                .iter()
                .map(|header| (header.key.to_string(), header.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default();
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let key = message.key().map(<[u8]>::to_vec);
    let mut attributes = vec![
        ("topic".to_string(), partition.topic.clone()),
        ("partition".to_string(), partition.partition.to_string()),
        ("offset".to_string(), message.offset().to_string()),
    ];
    if let Some(key) = &key {
        attributes.push(("key".to_string(), text(key)));
    }
    if let Some(timestamp) = message.timestamp().to_millis() {
        attributes.push(("timestamp".to_string(), timestamp.to_string()));
    }
    let inbound = InboundMessage {
        pipeline: shared.pipeline.clone(),
        source: KIND.to_string(),
        queue: partition.topic.clone(),
        subject: partition.topic.clone(),
        body: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        headers: headers
            .iter()
            .map(|(name, value)| (name.clone(), value.as_deref().map(text).unwrap_or_default()))
            .collect(),
        message_id: None,
        redelivered: false,
        delivery_count: None,
        attributes,
    };
    Held {
        partition,
        epoch,
        offset: message.offset(),
        key,
        headers,
        attempt: 1,
        message: inbound,
    }
}

/// Pauses each partition whose messages received and not settled reached the limit, and
/// resumes each paused one that fell to half of it.
fn balance(consumer: &BaseConsumer<Context>, shared: &Shared) {
    let limit = shared.source.in_flight_per_partition;
    let mut pause = TopicPartitionList::new();
    let mut resume = TopicPartitionList::new();
    {
        let mut state = shared.lock();
        let partitions: Vec<Partition> = state.floors.partitions().cloned().collect();
        for partition in partitions {
            let open = state.floors.open(Some(&partition));
            let paused = state.paused.contains(&partition);
            if !paused && open >= limit {
                pause.add_partition(&partition.topic, partition.partition);
                state.paused.insert(partition);
            } else if paused && open <= limit / 2 {
                resume.add_partition(&partition.topic, partition.partition);
                state.paused.remove(&partition);
            }
        }
    }
    for (list, action) in [(&pause, "pause"), (&resume, "resume")] {
        if list.count() == 0 {
            continue;
        }
        let done = if action == "pause" {
            consumer.pause(list)
        } else {
            consumer.resume(list)
        };
        if let Err(error) = done {
            warn!(pipeline = %shared.pipeline, %error, action, "Cannot {action} Kafka partitions.");
        }
    }
}

/// Commits every floor that moved past its last commit.
fn commit(consumer: &BaseConsumer<Context>, shared: &Shared, mode: CommitMode) {
    let floors = shared.lock().floors.to_commit();
    if floors.is_empty() {
        return;
    }
    shared.resume.committed(&floors);
    let mut list = TopicPartitionList::new();
    for (partition, offset) in &floors {
        if list
            .add_partition_offset(
                &partition.topic,
                partition.partition,
                Offset::Offset(*offset),
            )
            .is_err()
        {
            return;
        }
    }
    match consumer.commit(&list, mode) {
        Ok(()) if matches!(mode, CommitMode::Sync) => {
            let mut state = shared.lock();
            for (partition, offset) in &floors {
                state.floors.committed(partition, *offset);
            }
        }
        Ok(()) => {}
        Err(error) => {
            debug!(pipeline = %shared.pipeline, %error, "A Kafka commit failed; the next one carries the floor.");
        }
    }
}
