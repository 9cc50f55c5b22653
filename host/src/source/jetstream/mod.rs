//! NATS JetStream through async-nats: connect, make sure the stream, the durable pull consumer
//! and the dead-letter stream are there as configured, consume, settle.
//!
//! Architecture invariant: an ack is sent only when `process` says so, after commit, and is
//! confirmed by the server (a double ack); a rejected message is stored on the dead-letter
//! subject (the server confirmed it) before it is terminated. The server's confirmation of an
//! ack says only that it got it, not that this delivery was still current: a delivery that
//! outlived `ack_wait` may have been delivered again, and the claim makes that copy a
//! duplicate.
//!
//! Here: the error and the `Session` a pipeline consumes through. `connect` reaches NATS,
//! `topology` makes sure of the streams and the consumer, `received` settles a delivery,
//! `depths` reads what waits, `check` and `dead_letters` serve `idem check` and `idem dlq`.

pub mod check;
mod connect;
pub mod dead_letters;
mod depths;
mod received;
mod topology;

pub use connect::connect;
pub use depths::{Found, depths, inspect};
pub use received::{Received, header_pairs};

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::{JetStreamConfig, PipelineConfig, SourceConfig};
use crate::source::standing::Lent;
use crate::source::{Delivery, Source, SourceError};

use topology::{
    as_served, claim_window, ensure_consumer, ensure_dead_letter_stream, ensure_stream,
};

/// The source kind a plugin sees in `message.source`.
pub const KIND: &str = SourceConfig::JETSTREAM;

/// How long the server may take to answer a request (an ack, a publish, consumer info).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum JetStreamError {
    #[error("cannot reach NATS at {servers}: {reason}")]
    Connect { servers: String, reason: String },
    /// A refusal no retry can fix: the operator must change `setting`.
    #[error("NATS refused {subject}: {reason}; check {setting}")]
    Refused {
        subject: String,
        reason: String,
        setting: String,
    },
    #[error("JetStream could not {action} {name:?}: {reason}")]
    Request {
        action: &'static str,
        name: String,
        reason: String,
    },
    #[error("the consumer {consumer:?} on stream {stream:?} ended: {reason}")]
    ConsumerLost {
        stream: String,
        consumer: String,
        reason: String,
    },
}

impl JetStreamError {
    /// Whether the operator must change the configuration: retrying cannot help.
    pub fn is_refused(&self) -> bool {
        matches!(self, JetStreamError::Refused { .. })
    }
}

/// One pipeline's consumer on its stream.
pub struct Session {
    client: async_nats::Client,
    messages: pull::Stream,
    /// The most messages one pull holds.
    prefetch: usize,
    route: Arc<Route>,
}

/// What settling a delivery needs.
struct Route {
    context: jetstream::Context,
    pipeline: String,
    source: JetStreamConfig,
    /// The try each message the plugin asked to retry is on next, by stream sequence. The
    /// server counts every delivery (a restart, a crash, a late ack each spend one); idem
    /// counts only the plugin's tries. Kept in memory: after a restart, or on another host,
    /// a message starts again at try 1, so it gets more tries than `max_attempts`, never
    /// fewer.
    tries: std::sync::Mutex<std::collections::HashMap<u64, u32>>,
    /// The host is stopping: a dead letter that cannot be stored stops waiting.
    shutdown: CancellationToken,
}

/// The retried messages a host remembers the tries of at most; past it, it forgets them all
/// (they start again at try 1).
const REMEMBERED_TRIES: usize = 100_000;

impl Route {
    pub(super) fn next_try(&self, stream_sequence: u64) -> u32 {
        let tries = self.tries.lock().expect("tries");
        tries.get(&stream_sequence).copied().unwrap_or(1)
    }

    pub(super) fn record_try(&self, stream_sequence: u64, attempt: u32) {
        let mut tries = self.tries.lock().expect("tries");
        if tries.len() >= REMEMBERED_TRIES {
            tries.clear();
        }
        tries.insert(stream_sequence, attempt);
    }

    pub(super) fn forget(&self, stream_sequence: u64) {
        self.tries.lock().expect("tries").remove(&stream_sequence);
    }
}

/// How long `give_back` waits for the next message the pull holds: they are in memory, so a
/// wait this long means there are no more.
const GIVE_BACK_WAIT: Duration = Duration::from_millis(200);

/// How long `give_back` may take in all: a stop or a fault's pause does not wait on it longer.
const GIVE_BACK_WITHIN: Duration = Duration::from_secs(3);

impl Session {
    /// Connects, makes sure the stream, the consumer and the dead-letter stream are there as
    /// configured, and starts pulling.
    pub async fn open(
        source: &JetStreamConfig,
        pipeline: &PipelineConfig,
        prefetch: u16,
        shutdown: &CancellationToken,
    ) -> Result<Session, JetStreamError> {
        let client = connect(
            source,
            format!(
                "idem {} on {} (pid {})",
                pipeline.name,
                source.stream,
                std::process::id()
            ),
        )
        .await?;
        let context = jetstream::new(client.clone());
        ensure_stream(
            &context,
            source,
            &source.stream,
            source
                .subject
                .clone()
                .unwrap_or_else(|| format!("{}.>", source.stream)),
            "stream",
        )
        .await?;
        ensure_dead_letter_stream(&context, source).await?;
        let consumer = ensure_consumer(&context, source, claim_window(source, pipeline)).await?;
        let served = as_served(
            source,
            &consumer.cached_info().config,
            pipeline.max_attempts,
        )?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(usize::from(prefetch).max(1))
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
            .map_err(|error| request_error("pull from", &source.consumer, error))?;
        Ok(Session {
            client,
            messages,
            prefetch: usize::from(prefetch).max(1),
            route: Arc::new(Route {
                context,
                pipeline: pipeline.name.clone(),
                source: served,
                tries: std::sync::Mutex::default(),
                shutdown: shutdown.clone(),
            }),
        })
    }

    fn lost(&self, reason: String) -> SourceError {
        JetStreamError::ConsumerLost {
            stream: self.route.source.stream.clone(),
            consumer: self.route.source.consumer.clone(),
            reason,
        }
        .into()
    }
}

fn request_error(
    action: &'static str,
    name: &str,
    error: impl std::fmt::Display,
) -> JetStreamError {
    JetStreamError::Request {
        action,
        name: name.to_string(),
        reason: error.to_string(),
    }
}

impl Source for Session {
    type Config = JetStreamConfig;
    type Delivery = Received;
    const BROKER: &'static str = "NATS JetStream";

    async fn open(
        source: &JetStreamConfig,
        pipeline: &PipelineConfig,
        _lent: &Lent,
        shutdown: &CancellationToken,
    ) -> Result<Session, SourceError> {
        Ok(Session::open(source, pipeline, pipeline.effective_prefetch(), shutdown).await?)
    }

    async fn next(&mut self) -> Result<Received, SourceError> {
        loop {
            match self.messages.next().await {
                Some(Ok(original)) => return self.receive(original),
                Some(Err(error)) => match error.kind() {
                    pull::MessagesErrorKind::ConsumerDeleted
                    | pull::MessagesErrorKind::PushBasedConsumer
                    | pull::MessagesErrorKind::RequestLimitExceeded => {
                        return Err(self.lost(error.to_string()));
                    }
                    // Missed heartbeats and failed pulls while the server is away: the stream
                    // pulls again once the client has reconnected.
                    _ => warn!(
                        pipeline = %self.route.pipeline,
                        %error,
                        "JetStream consumer interrupted; waiting for the server."
                    ),
                },
                None => return Err(self.lost("the message stream ended".into())),
            }
        }
    }

    async fn stop(&mut self) {
        // Nothing more is pulled once the stream is dropped at close.
    }

    /// What the pull holds and has not handed out (a prefetch's worth at most, each waited
    /// for briefly): given back with a `Nak`, so another host takes it now rather than after
    /// `ack_wait` (either way one delivery is spent), and dead-lettered on its last delivery
    /// (given back, it would be abandoned: `Delivery::requeue`). The settlements go out
    /// together, and the whole is bounded by `GIVE_BACK_WITHIN`: a loaded server confirms
    /// each slowly, and the pull goes on fetching while it is read. What is left is the
    /// server's to deliver again after `ack_wait`.
    async fn give_back(&mut self) -> usize {
        let mut held = Vec::new();
        let giving = async {
            while held.len() < self.prefetch {
                let Ok(Some(Ok(original))) =
                    tokio::time::timeout(GIVE_BACK_WAIT, self.messages.next()).await
                else {
                    break;
                };
                if let Ok(received) = self.receive(original) {
                    held.push(received);
                }
            }
            let given = futures::future::join_all(held.iter().map(Received::give_back)).await;
            given.into_iter().filter(|given| *given).count()
        };
        match tokio::time::timeout(GIVE_BACK_WITHIN, giving).await {
            Ok(given) => given,
            Err(_) => {
                tracing::warn!(within = ?GIVE_BACK_WITHIN, "Not every prefetched message was given back in time; the server delivers the rest again after ack_wait.");
                0
            }
        }
    }

    async fn close(self) {
        drop(self.messages);
        if let Err(error) = self.client.drain().await {
            tracing::debug!(%error, "Draining the NATS connection failed.");
        }
    }
}
