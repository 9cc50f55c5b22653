//! Where a pipeline's messages come from, and how each delivery is settled.
//!
//! A [`Source`] consumes one pipeline's queue; [`consumer`](crate::pipeline::consume) drives it,
//! [`process`](crate::pipeline::process) decides each delivery's fate, and the delivery carries that fate
//! out with its broker ([`Delivery`]). Neither `consumer` nor `process` names a broker.
//!
//! Architecture invariant: a delivery is acknowledged only when `process` says so, after the
//! transaction committed; a copy to a dead-letter or retry destination is confirmed by the
//! broker before the original is acknowledged.
//!
//! This file is the one place that chooses a kind of source: each operation below (consume,
//! depths, dead-letter passes, `idem check`, `idem status`) matches on the pipeline's
//! [`SourceConfig`] once and hands the kind's module its own settings. A new kind brings its
//! folder here, its settings file in `config/source/`, and one arm in each match.

pub mod dead_letters;
pub mod headers;
pub mod jetstream;
pub mod kafka;
pub mod rabbitmq;
pub mod standing;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{AmqpConfig, Config, Destination, PipelineConfig, SourceConfig};
use crate::message::InboundMessage;

use self::jetstream::JetStreamError;
use self::kafka::KafkaError;
use self::rabbitmq::AmqpError;
use self::standing::Lent;

/// Now, in seconds since 1970 (a dead letter's `x-idem-rejected-at`).
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// What a pipeline's source holds for it, as far as the broker says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Depths {
    /// Messages waiting to be delivered (RabbitMQ: ready; JetStream: the consumer's pending).
    pub waiting: u64,
    /// Delivered and not settled yet (JetStream only: RabbitMQ does not say).
    pub unacknowledged: Option<u64>,
    /// Messages kept aside (the dead-letter queue, or the dead-letter stream: every pipeline's
    /// that share it). `None` when it does not exist yet.
    pub dead_letters: Option<u64>,
    /// How long the oldest message not yet settled has been stored (JetStream only: RabbitMQ
    /// does not say); zero when none waits.
    pub oldest_age: Option<Duration>,
    /// What waits per partition of the topics consumed, by topic and partition (Kafka only).
    pub partitions: BTreeMap<(String, i32), u64>,
}

/// A pipeline's source asked for its depths again and again (the sampled gauges) over one
/// kept connection, opened on first use and again after a failure.
#[derive(Default)]
pub struct DepthProbe {
    rabbitmq: Option<lapin::Connection>,
    jetstream: Option<async_nats::Client>,
    kafka: Option<std::sync::Arc<kafka::Reader>>,
}

impl DepthProbe {
    /// What `pipeline`'s source holds now.
    pub async fn depths(&mut self, pipeline: &PipelineConfig) -> Result<Depths, SourceError> {
        match &pipeline.source {
            SourceConfig::RabbitMq(source) => {
                Ok(rabbitmq::depths(&mut self.rabbitmq, source).await?)
            }
            SourceConfig::JetStream(source) => {
                Ok(jetstream::depths(&mut self.jetstream, source).await?)
            }
            SourceConfig::Kafka(source) => Ok(kafka::depths(&mut self.kafka, source).await?),
        }
    }
}

/// Something done with a pipeline's [`Source`] whatever its kind: [`for_kind`] calls `run`
/// with the kind's type and its settings (the consume loop is one).
pub trait ForKind {
    type Output;

    fn run<S: Source>(self, config: &S::Config) -> Self::Output;
}

/// Runs `task` with `pipeline`'s kind of source.
pub fn for_kind<T: ForKind>(pipeline: &PipelineConfig, task: T) -> T::Output {
    match &pipeline.source {
        SourceConfig::RabbitMq(source) => task.run::<rabbitmq::Session>(source),
        SourceConfig::JetStream(source) => task.run::<jetstream::Session>(source),
        SourceConfig::Kafka(source) => task.run::<kafka::Session>(source),
    }
}

/// One thing `idem check` found about the sources: fine, a problem to fix before `idem run`,
/// or a broker out of reach (which `idem run` would wait for).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    Ok(String),
    Problem(String),
    Unreachable(String),
}

impl Finding {
    /// A look that failed with `error`, said after `prefix`: a problem when the broker
    /// refused a setting, else an outage.
    fn failed(prefix: &str, error: impl Into<SourceError>) -> Finding {
        let error = error.into();
        let text = format!("{prefix}{error}");
        if error.is_refused() {
            Finding::Problem(text)
        } else {
            Finding::Unreachable(text)
        }
    }
}

/// Connects to every broker `config` uses as `idem run` would (the pipelines' and the AMQP
/// outbox destinations') and looks at each pipeline's queue or stream, creating nothing.
pub async fn check(config: &Config) -> Vec<Finding> {
    let mut queues = Vec::new();
    let mut streams = Vec::new();
    let mut topics = Vec::new();
    for pipeline in &config.pipelines {
        match &pipeline.source {
            SourceConfig::RabbitMq(source) => queues.push((pipeline, source)),
            SourceConfig::JetStream(source) => streams.push((pipeline, source)),
            SourceConfig::Kafka(source) => topics.push((pipeline, source)),
        }
    }
    let destinations = config
        .outbox
        .iter()
        .flat_map(|outbox| outbox.destinations.values())
        .filter_map(|destination| match destination {
            Destination::Amqp { broker, .. } => Some(broker),
            Destination::Http { .. } => None,
        });
    let mut brokers: Vec<&AmqpConfig> = Vec::new();
    for broker in queues
        .iter()
        .map(|(_, source)| &source.broker)
        .chain(destinations)
    {
        if !brokers.contains(&broker) {
            brokers.push(broker);
        }
    }
    let mut findings = rabbitmq::check::check(&brokers, &queues).await;
    findings.extend(jetstream::check::check(&streams).await);
    findings.extend(kafka::check::check(&topics).await);
    findings
}

/// One line of `idem status` about a pipeline's source: what `name` (a queue, a stream)
/// holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusLine {
    pub label: &'static str,
    pub name: String,
    /// What it holds, in words, or why that is unknown.
    pub state: String,
    /// The same as numbers (`ready`, `consumers`, …), for `idem status --format json`.
    pub figures: Vec<(&'static str, u64)>,
    /// Why the broker could not say; `None` when it did.
    pub error: Option<String>,
    /// Whether `error` is the broker refusing a setting (else it was out of reach).
    pub refused: bool,
}

impl StatusLine {
    /// What `name` holds, as the broker said it.
    fn known(
        label: &'static str,
        name: String,
        state: String,
        figures: Vec<(&'static str, u64)>,
    ) -> StatusLine {
        StatusLine {
            label,
            name,
            state,
            figures,
            error: None,
            refused: false,
        }
    }

    /// What `name` holds is unknown: its broker failed with `error`.
    fn unknown(label: &'static str, name: String, error: impl Into<SourceError>) -> StatusLine {
        let error = error.into();
        StatusLine {
            label,
            name,
            state: format!("unknown ({error})"),
            figures: Vec::new(),
            refused: error.is_refused(),
            error: Some(error.to_string()),
        }
    }
}

/// What `pipeline`'s source holds now, as `idem status` shows it.
pub async fn status(pipeline: &PipelineConfig) -> Vec<StatusLine> {
    match &pipeline.source {
        SourceConfig::RabbitMq(source) => rabbitmq::check::status(source).await,
        SourceConfig::JetStream(source) => jetstream::check::status(source).await,
        SourceConfig::Kafka(source) => kafka::check::status(source).await,
    }
}

/// The attributes a plain publish to `subject` arrives with on a source of `kind` (as
/// `message.source` names it), for `idem try` and `idem test`.
pub fn published_attributes(kind: &str, subject: &str) -> Vec<(String, String)> {
    match kind {
        SourceConfig::RABBITMQ => rabbitmq::published_attributes(subject),
        _ => Vec::new(),
    }
}

/// Goes once through the dead letters `pipeline` kept when the pass began, oldest first,
/// calls `seen` with each selected one, and replays it if `action` says so. Returns how many
/// were selected.
pub async fn pass_dead_letters(
    pipeline: &PipelineConfig,
    selection: &dead_letters::Selection,
    action: dead_letters::Action,
    seen: impl FnMut(&dead_letters::DeadLetter),
) -> Result<u64, SourceError> {
    let _turn = dead_letters::turn(pipeline.dead_letter()).await;
    match &pipeline.source {
        SourceConfig::RabbitMq(source) => {
            Ok(rabbitmq::dead_letters::pass(source, pipeline, selection, action, seen).await?)
        }
        SourceConfig::JetStream(source) => {
            Ok(jetstream::dead_letters::pass(source, pipeline, selection, action, seen).await?)
        }
        SourceConfig::Kafka(source) => {
            Ok(kafka::dead_letters::pass(source, pipeline, selection, action, seen).await?)
        }
    }
}

/// Why a source stopped or could not start.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    RabbitMq(#[from] AmqpError),
    #[error(transparent)]
    JetStream(#[from] JetStreamError),
    #[error(transparent)]
    Kafka(#[from] KafkaError),
}

impl SourceError {
    /// A refusal no retry can fix (credentials, TLS, a queue declared otherwise): the host
    /// stops and names the setting to change.
    pub fn is_refused(&self) -> bool {
        match self {
            SourceError::RabbitMq(error) => error.is_refused(),
            SourceError::JetStream(error) => error.is_refused(),
            SourceError::Kafka(error) => error.is_refused(),
        }
    }
}

/// One pipeline's consumer on its broker.
pub trait Source: Send + Sized + 'static {
    /// The source's own settings (`[pipelines.<name>.source]`, resolved).
    type Config: Clone + Send + Sync + 'static;
    /// A message received and not settled yet.
    type Delivery: Delivery;
    /// The broker's name, for the logs: "RabbitMQ".
    const BROKER: &'static str;

    /// Connects, makes sure what the pipeline consumes is there as configured, and starts
    /// consuming. `lent`: what the pipeline keeps for it across openings (where its consumer
    /// resumes in a log read by offset, its standing). `shutdown` ends any wait a settlement
    /// would make (a retry's delay).
    fn open(
        config: &Self::Config,
        pipeline: &PipelineConfig,
        lent: &Lent,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<Self, SourceError>> + Send;

    /// The next delivery, waiting for one. `Err` when the consumer is lost: the caller opens
    /// the source again. Cancel-safe: dropping the future before it is ready loses nothing
    /// (the consume loop waits on it beside shutdown and a batch's linger).
    fn next(&mut self) -> impl Future<Output = Result<Self::Delivery, SourceError>> + Send;

    /// Stops new deliveries; those already received can still be settled.
    fn stop(&mut self) -> impl Future<Output = ()> + Send;

    /// After `stop`: returns to the broker what was received and not handed out by `next`
    /// (prefetched), so other hosts take it while this one cannot apply anything (a
    /// configuration fault pauses its pipeline). Returns how many went back. Deliveries
    /// handed out stay this host's to settle.
    fn give_back(&mut self) -> impl Future<Output = usize> + Send;

    /// Closes the connection; deliveries not settled go back to the broker.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// A delivery waiting for its fate. Every method returns whether the broker took it: `false`
/// means its connection is gone, the broker will deliver the message again, and the claim
/// makes a repeat of an applied message a duplicate.
pub trait Delivery: Send + Sync + 'static {
    /// What the plugin sees.
    fn message(&self) -> &InboundMessage;

    /// 1 for a first try, 2 after one retryable failure, …
    fn attempt(&self) -> u32;

    /// How the logs name this delivery (its tag or sequence number).
    fn describe(&self) -> String;

    /// Done with: applied, a duplicate, stale or skipped.
    fn ack(&self) -> impl Future<Output = bool> + Send;

    /// Rejected for its own content: kept on the dead-letter destination with `error_kind`
    /// and `reason`, then acknowledged.
    fn dead_letter(
        &self,
        error_kind: &'static str,
        reason: &str,
    ) -> impl Future<Output = bool> + Send;

    /// The plugin asked for another try: delivered again after `delay`, as try `attempt`.
    fn retry(&self, attempt: u32, delay: Duration) -> impl Future<Output = bool> + Send;

    /// Not at fault, not done (the host is stopping, a conflict outlasted its budget): back
    /// to the queue as it came.
    fn requeue(&self) -> impl Future<Output = bool> + Send;

    /// Never started (the host stopped or paused first): back to the broker at once, where
    /// it was (RabbitMQ: a `nack`; JetStream: a `Nak`, or a dead letter on its last delivery,
    /// which given back would be abandoned).
    fn give_back(&self) -> impl Future<Output = bool> + Send;
}
