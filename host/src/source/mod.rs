//! Where a pipeline's messages come from, and how each delivery is settled.
//!
//! A [`Source`] consumes one pipeline's queue; [`consumer`](crate::consumer) drives it,
//! [`process`](crate::process) decides each delivery's fate, and the delivery carries that fate
//! out with its broker ([`Delivery`]). Neither `consumer` nor `process` names a broker.
//!
//! Architecture invariant: a delivery is acknowledged only when `process` says so, after the
//! transaction committed; a copy to a dead-letter or retry destination is confirmed by the
//! broker before the original is acknowledged.

pub mod dead_letters;
pub mod headers;
pub mod jetstream;
pub mod rabbitmq;

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::PipelineConfig;
use crate::message::InboundMessage;

use self::jetstream::JetStreamError;
use self::rabbitmq::AmqpError;

/// Now, in seconds since 1970 (a dead letter's `x-idem-rejected-at`).
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// What a pipeline's source holds for it, as far as the broker says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Depths {
    /// Messages waiting to be delivered (RabbitMQ: ready; JetStream: the consumer's pending).
    pub waiting: u64,
    /// Delivered and not settled yet (JetStream only: RabbitMQ does not say).
    pub unacknowledged: Option<u64>,
    /// Messages kept aside (the dead-letter queue, or the dead-letter stream: every pipeline's
    /// that share it). `None` when it does not exist yet.
    pub dead_letters: Option<u64>,
}

/// Looks up `pipeline`'s depths with a connection of its own.
pub async fn depths(pipeline: &PipelineConfig) -> Result<Depths, SourceError> {
    match &pipeline.source {
        crate::config::SourceConfig::RabbitMq(source) => Ok(rabbitmq::depths(source).await?),
        crate::config::SourceConfig::JetStream(source) => Ok(jetstream::depths(source).await?),
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
        crate::config::SourceConfig::RabbitMq(source) => {
            Ok(rabbitmq::dead_letters::pass(source, pipeline, selection, action, seen).await?)
        }
        crate::config::SourceConfig::JetStream(source) => {
            Ok(jetstream::dead_letters::pass(source, pipeline, selection, action, seen).await?)
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
}

impl SourceError {
    /// A refusal no retry can fix (credentials, TLS, a queue declared otherwise): the host
    /// stops and names the setting to change.
    pub fn is_refused(&self) -> bool {
        match self {
            SourceError::RabbitMq(error) => error.is_refused(),
            SourceError::JetStream(error) => error.is_refused(),
        }
    }
}

/// One pipeline's consumer on its broker.
pub trait Source: Send + Sized + 'static {
    /// A message received and not settled yet.
    type Delivery: Delivery;
    /// The broker's name, for the logs: "RabbitMQ".
    const BROKER: &'static str;

    /// Connects, makes sure what the pipeline consumes is there as configured, and starts
    /// consuming. `shutdown` ends any wait a settlement would make (a retry's delay).
    fn open(
        pipeline: &PipelineConfig,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<Self, SourceError>> + Send;

    /// The next delivery, waiting for one. `Err` when the consumer is lost: the caller opens
    /// the source again. Cancel-safe: dropping the future before it is ready loses nothing
    /// (the consume loop waits on it beside shutdown and a batch's linger).
    fn next(&mut self) -> impl Future<Output = Result<Self::Delivery, SourceError>> + Send;

    /// Stops new deliveries; those already received can still be settled.
    fn stop(&mut self) -> impl Future<Output = ()> + Send;

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
}
