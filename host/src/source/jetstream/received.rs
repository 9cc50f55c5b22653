//! A delivery from the stream and how it is settled: acked, given back with a delay, dead-
//! lettered on the dead-letter subject (kept until stored on its last delivery), with the
//! producer's headers copied and the plugin's tries counted per message.

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, AckKind};
use tracing::{error, warn};

use crate::backoff::Backoff;
use crate::message::InboundMessage;
use crate::source::{self, Delivery, SourceError, headers, unix_seconds};

use super::topology::ensure_dead_letter_stream;
use super::{KIND, Route, Session};

/// A delivery from the pipeline's stream.
pub struct Received {
    message: InboundMessage,
    original: jetstream::Message,
    stream_sequence: u64,
    /// The server's count of deliveries of this message, this one included.
    delivered: u32,
    route: Arc<Route>,
    /// Sends in-progress acks while the delivery is held; stops when it is dropped.
    _progress: Option<Ticker>,
}

/// A task that stops when this is dropped.
pub(super) struct Ticker(tokio::task::JoinHandle<()>);

impl Drop for Ticker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Session {
    pub(super) fn receive(&self, original: jetstream::Message) -> Result<Received, SourceError> {
        let info = original
            .info()
            .map_err(|error| self.lost(format!("a message without delivery info: {error}")))?;
        let delivered = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
        let stream_sequence = info.stream_sequence;
        let attributes = vec![
            ("stream-sequence".to_string(), stream_sequence.to_string()),
            (
                "consumer-sequence".to_string(),
                info.consumer_sequence.to_string(),
            ),
            ("consumer".to_string(), info.consumer.to_string()),
        ];
        let headers = original
            .headers
            .as_ref()
            .map(header_pairs)
            .unwrap_or_default();
        let message_id = original.headers.as_ref().and_then(producer_message_id);
        let message = InboundMessage {
            pipeline: self.route.pipeline.clone(),
            source: KIND.to_string(),
            queue: self.route.source.stream.clone(),
            subject: original.subject.to_string(),
            body: original.payload.to_vec(),
            headers,
            message_id,
            redelivered: delivered > 1,
            delivery_count: Some(delivered),
            attributes,
        };
        let progress = self.route.source.in_progress.then(|| {
            let acker = original.clone();
            let every = self.route.source.ack_wait / 2;
            Ticker(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    if acker.ack_with(AckKind::Progress).await.is_err() {
                        return;
                    }
                }
            }))
        });
        Ok(Received {
            message,
            original,
            stream_sequence,
            delivered,
            route: Arc::clone(&self.route),
            _progress: progress,
        })
    }
}

/// The producer's message id: kept in `x-idem-message-id` on a message the host replayed
/// (whose `Nats-Msg-Id` is the host's), else its `Nats-Msg-Id`.
pub(super) fn producer_message_id(headers: &HeaderMap) -> Option<String> {
    let id = headers.get(async_nats::header::NATS_MESSAGE_ID)?.as_str();
    let kept = headers
        .get(headers::MESSAGE_ID)
        .filter(|_| id.starts_with(REPLAY_ID_PREFIX));
    Some(kept.map_or(id, |kept| kept.as_str()).to_string())
}

/// How the `Nats-Msg-Id` of a message the host replayed begins.
pub(super) const REPLAY_ID_PREFIX: &str = "idem-replay:";

/// `headers` without the server's directives (`Nats-Msg-Id`, `Nats-Expected-Stream`, …,
/// which would make the server drop or refuse a copy published elsewhere) and without the
/// `x-idem-*` ones a dead letter does not keep (the host writes its own).
pub(super) fn copied_headers(headers: Option<&HeaderMap>) -> HeaderMap {
    let mut copy = HeaderMap::new();
    for (name, values) in headers.into_iter().flat_map(HeaderMap::iter) {
        let name = name.to_string();
        let directive = name
            .get(..5)
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case("nats-"));
        if directive || !source::headers::is_kept_on_a_dead_letter(&name) {
            continue;
        }
        for value in values {
            copy.append(name.as_str(), value.as_str());
        }
    }
    copy
}

/// Header pairs in the order of their names; a name with several values gives several pairs.
pub fn header_pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = headers
        .iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| (name.to_string(), value.as_str().to_string()))
        })
        .collect();
    pairs.sort();
    pairs
}

impl Received {
    /// Sends `kind` and waits for the server to confirm it got it.
    async fn settle(&self, kind: AckKind) -> bool {
        let last = matches!(kind, AckKind::Ack | AckKind::Term);
        match self.original.double_ack_with(kind).await {
            Ok(()) => {
                if last {
                    self.route.forget(self.stream_sequence);
                }
                true
            }
            Err(error) => {
                warn!(pipeline = %self.route.pipeline, %error, "JetStream did not confirm the settlement; the message will be delivered again.");
                false
            }
        }
    }
}

impl Received {
    /// Why this delivery is the last the server makes (`max_deliver`), if it is: a message
    /// given back now would be abandoned, neither applied nor dead-lettered.
    fn last_delivery(&self) -> Option<String> {
        let max_deliver = self.route.source.max_deliver?;
        (i64::from(self.delivered) >= max_deliver).then(|| {
            format!(
                "this was delivery {} of the {max_deliver} the stream's consumer allows (max_deliver)",
                self.delivered
            )
        })
    }
}

impl Delivery for Received {
    fn message(&self) -> &InboundMessage {
        &self.message
    }

    fn attempt(&self) -> u32 {
        self.route.next_try(self.stream_sequence)
    }

    fn describe(&self) -> String {
        format!("stream sequence {}", self.stream_sequence)
    }

    async fn ack(&self) -> bool {
        self.settle(AckKind::Ack).await
    }

    async fn dead_letter(&self, error_kind: &'static str, reason: &str) -> bool {
        let route = &self.route;
        let mut headers = copied_headers(self.original.headers.as_ref());
        let rejection = headers::Rejection {
            error_kind,
            reason,
            pipeline: &route.pipeline,
            queue: &route.source.stream,
        };
        for (name, value) in rejection.headers() {
            headers.insert(name, value.as_str());
        }
        headers.insert(headers::SUBJECT, self.message.subject.as_str());
        headers.insert(
            headers::STREAM_SEQUENCE,
            self.stream_sequence.to_string().as_str(),
        );
        headers.insert(headers::REJECTED_AT, unix_seconds().to_string().as_str());
        // The server drops a second copy with the same id, so a dead letter published again
        // after a lost confirmation is stored once; the producer's id stays beside it. The
        // id names the consumer: two pipelines rejecting the same message each keep theirs.
        if let Some(id) = &self.message.message_id {
            headers.insert(headers::MESSAGE_ID, id.as_str());
        }
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!(
                "idem-dead-letter:{}:{}:{}",
                route.source.stream, route.source.consumer, self.stream_sequence
            )
            .as_str(),
        );
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let mut recaptured = false;
        loop {
            let stored = async {
                route
                    .context
                    .publish_with_headers(
                        route.source.dead_letter_subject.clone(),
                        headers.clone(),
                        self.original.payload.clone(),
                    )
                    .await?
                    .await
            };
            let error = match stored.await {
                Ok(_) => return self.settle(AckKind::Term).await,
                Err(error) => error,
            };
            if error.kind() == PublishErrorKind::StreamNotFound && !recaptured {
                recaptured = true;
                if recapture_dead_letters(route).await {
                    continue;
                }
            }
            let Some(last) = self.last_delivery() else {
                warn!(pipeline = %route.pipeline, %error, subject = %route.source.dead_letter_subject, "Cannot store the dead letter; the message goes back to its stream.");
                return self
                    .settle(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
            };
            // Given back, it would be abandoned: kept here (marked in progress) until the
            // dead letter is stored.
            if route.shutdown.is_cancelled() {
                error!(pipeline = %route.pipeline, %error, stream = %route.source.stream, stream_sequence = self.stream_sequence, "Cannot store the dead letter, and {last}: the host is stopping, so the message stays in the stream undelivered; republish it from there.");
                return false;
            }
            let delay = backoff.next_delay();
            warn!(pipeline = %route.pipeline, %error, subject = %route.source.dead_letter_subject, retry_in_ms = delay.as_millis() as u64, "Cannot store the dead letter, and {last}: kept here and tried again.");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = route.shutdown.cancelled() => {}
            }
        }
    }

    async fn retry(&self, attempt: u32, delay: Duration) -> bool {
        if let Some(reason) = self.last_delivery() {
            return self
                .dead_letter(
                    "retries-exhausted",
                    &format!("the plugin asked for try {attempt}, but {reason}"),
                )
                .await;
        }
        self.route.record_try(self.stream_sequence, attempt);
        self.settle(AckKind::Nak(Some(delay))).await
    }

    async fn requeue(&self) -> bool {
        if let Some(reason) = self.last_delivery() {
            // Given back, it would be abandoned: kept as a dead letter, to be replayed.
            return self
                .dead_letter(
                    "deliveries-exhausted",
                    &format!("the host could not finish it (it is stopping, or the database kept failing), and {reason}"),
                )
                .await;
        }
        self.settle(AckKind::Nak(None)).await
    }

    async fn give_back(&self) -> bool {
        self.requeue().await
    }
}

/// A dead letter found no stream: another pipeline's host, updating the shared dead-letter
/// stream from an earlier reading of it, may have dropped this pipeline's subject after this
/// host checked it. Makes the stream capture the subject again (with `declare`); returns
/// whether it now does.
pub(super) async fn recapture_dead_letters(route: &Route) -> bool {
    let source = &route.source;
    if !source.declare {
        return false;
    }
    match ensure_dead_letter_stream(&route.context, source).await {
        Ok(()) => true,
        Err(error) => {
            warn!(pipeline = %route.pipeline, %error, subject = %source.dead_letter_subject, "No stream captures the dead-letter subject, and it cannot be made to.");
            false
        }
    }
}
