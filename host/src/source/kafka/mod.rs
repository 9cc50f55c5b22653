//! Apache Kafka through rdkafka (librdkafka): a pipeline's topics read by one consumer of a
//! consumer group, exactly once into PostgreSQL by the claim. Offsets are only where to
//! resume: a partition's committed offset never passes a message whose transaction has not
//! committed (`offsets`).
//!
//! Architecture invariant: a message counts as settled only when `process` says so, after
//! commit (or once its dead letter's delivery report came back); the poll thread commits
//! each partition's settled floor, never past an unsettled message, and a late settlement of
//! a revoked or lost partition is refused by its assignment's epoch.
//!
//! Here: the error and the `Session` a pipeline consumes through. `connect` sets the
//! clients up, `topology` makes sure of the topics, `poll` owns the consumer (rebalances,
//! pauses, commits), `resume` says where an assigned partition starts (and records the committed floors in the
//! database), `lanes` orders what it hands out, `received` settles a delivery,
//! `depths` reads what waits, `check` and `dead_letters` serve `idem check` and `idem dlq`.

pub mod check;
mod connect;
pub mod dead_letters;
mod depths;
pub mod lanes;
pub mod offsets;
mod poll;
mod received;
mod resume;
mod topology;

pub use depths::{Found, depths};
pub use received::Received;
pub use topology::Reader;

use std::sync::{Arc, Condvar, Mutex};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError as ClientError, RDKafkaErrorCode};
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;

use crate::config::{ClaimMode, KafkaConfig, KafkaStart, PipelineConfig, SourceConfig};
use crate::source::standing::Lent;
use crate::source::{Source, SourceError};

use poll::{Context, Shared, State};
use resume::Resume;

/// The source kind a plugin sees in `message.source`.
pub const KIND: &str = SourceConfig::KAFKA;

#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    #[error("cannot reach Kafka at {brokers}: {reason}")]
    Connect { brokers: String, reason: String },
    /// A refusal no retry can fix: the operator must change `setting`.
    #[error("Kafka refused: {reason}; check {setting}")]
    Refused { reason: String, setting: String },
    #[error("Kafka could not {action} {name:?}: {reason}")]
    Request {
        action: &'static str,
        name: String,
        reason: String,
    },
    #[error("the Kafka client failed: {0}")]
    Client(String),
}

impl KafkaError {
    /// Whether the operator must change the configuration: retrying cannot help.
    pub fn is_refused(&self) -> bool {
        matches!(self, KafkaError::Refused { .. })
    }

    /// `error` (with librdkafka's `reason`, when it gave one) as a refusal naming the setting
    /// of `table` to change, when no retry can fix it: a failed login or TLS handshake, a
    /// topic or group not authorised.
    pub(super) fn refused(
        table: &str,
        error: &ClientError,
        reason: Option<&str>,
    ) -> Option<KafkaError> {
        let setting = match error.rdkafka_error_code()? {
            RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => "sasl",
            RDKafkaErrorCode::SSL => "tls",
            RDKafkaErrorCode::TopicAuthorizationFailed => "topic",
            RDKafkaErrorCode::GroupAuthorizationFailed => "group",
            _ => return None,
        };
        Some(KafkaError::Refused {
            reason: match reason {
                Some(reason) => format!("{error}: {reason}"),
                None => error.to_string(),
            },
            setting: format!("{table}.{setting}"),
        })
    }
}

/// One pipeline's consumer in its group.
pub struct Session {
    shared: Arc<Shared>,
    producer: FutureProducer,
    poller: Option<std::thread::JoinHandle<()>>,
    /// Ends the task recording committed floors in the database.
    closed: CancellationToken,
}

impl Session {
    /// Makes sure the topics are there, then joins the group on its own polling thread.
    pub async fn open(
        source: &KafkaConfig,
        pipeline: &PipelineConfig,
        lent: &Lent,
        shutdown: &CancellationToken,
    ) -> Result<Session, KafkaError> {
        let client = format!("idem {} (pid {})", pipeline.name, std::process::id());
        topology::ensure_topics(source, &client).await?;
        let producer: FutureProducer = connect::producer(source, &client)
            .create()
            .map_err(|error| KafkaError::Client(error.to_string()))?;
        let window = match (source.start, pipeline.claim) {
            (KafkaStart::Window, ClaimMode::Ledger) => Some(pipeline.retention.window),
            _ => None,
        };
        let resume = Resume::read(
            &pipeline.name,
            source.start,
            window,
            lent.offsets.clone(),
            &source.topics,
        )
        .await;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            ready: tokio::sync::Notify::new(),
            settled: Condvar::new(),
            pipeline: pipeline.name.clone(),
            source: source.clone(),
            resume,
            standing: Arc::clone(&lent.standing),
            shutdown: shutdown.clone(),
        });
        let consumer: BaseConsumer<Context> = connect::consumer(source, &client)
            .create_with_context(Context {
                shared: Arc::clone(&shared),
            })
            .map_err(|error| KafkaError::Client(error.to_string()))?;
        let topics: Vec<&str> = source.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|error| topology::unreachable_or_refused(source, &error))?;
        let polled = Arc::clone(&shared);
        let poller = std::thread::Builder::new()
            .name(format!("kafka {}", pipeline.name))
            .spawn(move || poll::run(consumer, polled))
            .map_err(|error| KafkaError::Client(error.to_string()))?;
        let recorded = Arc::clone(&shared);
        let closed = CancellationToken::new();
        let recording = closed.clone();
        tokio::spawn(async move { recorded.resume.record(&recording).await });
        Ok(Session {
            shared,
            producer,
            poller: Some(poller),
            closed,
        })
    }

    /// Tells the poll thread to commit and leave, waits for it, then records the last
    /// floors it committed.
    async fn finish(&mut self) {
        self.shared.lock().closing = true;
        if let Some(poller) = self.poller.take() {
            let _ = tokio::task::spawn_blocking(move || poller.join()).await;
        }
        self.closed.cancel();
        self.shared.resume.record_last().await;
        self.shared.standing.set_problem(None);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Closed without `close` (a task aborted): the thread still commits and leaves.
        self.shared.lock().closing = true;
        self.closed.cancel();
    }
}

impl Source for Session {
    type Config = KafkaConfig;
    type Delivery = Received;
    const BROKER: &'static str = "Kafka";

    async fn open(
        source: &KafkaConfig,
        pipeline: &PipelineConfig,
        lent: &Lent,
        shutdown: &CancellationToken,
    ) -> Result<Session, SourceError> {
        Ok(Session::open(source, pipeline, lent, shutdown).await?)
    }

    async fn next(&mut self) -> Result<Received, SourceError> {
        loop {
            let notified = self.shared.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.shared.lock();
                if let Some(failure) = state.failure.take() {
                    return Err(failure.into());
                }
                if let Some((lane, held)) = state.lanes.take() {
                    *state.out.entry(held.partition.clone()).or_default() += 1;
                    drop(state);
                    return Ok(Received::new(
                        held,
                        lane,
                        Arc::clone(&self.shared),
                        self.producer.clone(),
                    ));
                }
            }
            notified.await;
        }
    }

    async fn stop(&mut self) {
        // The consume loop takes nothing more; the poll thread goes on until close, so the
        // group keeps this member (and its commits) while the last transactions settle.
    }

    /// What was received and not handed out stays unsettled, so the partition's next owner
    /// (or this consumer, when it joins again) reads it from the committed floor.
    async fn give_back(&mut self) -> usize {
        let mut state = self.shared.lock();
        let waiting = state.lanes.waiting();
        state.lanes = lanes::Lanes::default();
        waiting
    }

    async fn close(mut self) {
        self.finish().await;
    }
}
