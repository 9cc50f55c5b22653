//! A JetStream pipeline's dead letters, read for
//! [`source::dead_letters`](crate::source::dead_letters): the messages on its dead-letter
//! subject in the dead-letter stream.
//!
//! A stream is read without taking anything, so looking moves nothing: each dead letter is
//! fetched by sequence (the next one on the pipeline's dead-letter subject). A replayed message
//! is published to the subject it was consumed from, stored on the pipeline's stream (the
//! server confirmed it), and only then deleted from the dead-letter stream.

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, stream};

use crate::config::{JetStreamConfig, PipelineConfig, subject_matches};
use crate::message::InboundMessage;
use crate::source::dead_letters::{Action, DeadLetter, SCAN_MESSAGES, Selection, Walk};
use crate::source::headers;

use super::received::{REPLAY_ID_PREFIX, copied_headers};
use super::topology::find_stream;
use super::{JetStreamError, KIND, connect, header_pairs, request_error};

/// Goes once through the dead letters on `source`'s dead-letter subject that were stored when
/// the pass began, oldest first, calls `seen` with each selected one and replays it if
/// `action` says so. Returns how many were selected.
pub async fn pass(
    source: &JetStreamConfig,
    pipeline: &PipelineConfig,
    selection: &Selection,
    action: Action,
    seen: impl FnMut(&DeadLetter),
) -> Result<u64, JetStreamError> {
    let client = connect(source, format!("idem dlq {}", pipeline.name)).await?;
    let context = jetstream::new(client);
    let Some(stream) = find_stream(&context, &source.dead_letter_stream).await? else {
        // `idem run` creates it; nothing was dead-lettered yet.
        return Ok(0);
    };
    // Only what is there now: a message dead-lettered again while this runs is not met twice.
    let last = stream.cached_info().state.last_sequence;
    let mut walk = Walk::new(selection, seen);
    let mut next = 1;
    while next <= last && !walk.is_done() {
        let stored = match stream
            .get_first_raw_message_by_subject(&source.dead_letter_subject, next)
            .await
        {
            Ok(stored) if stored.sequence <= last => stored,
            Ok(_) => break,
            Err(error) if matches!(error.kind(), RawMessageErrorKind::NoMessageFound) => break,
            Err(error) => {
                return Err(request_error(
                    "read from",
                    &source.dead_letter_stream,
                    error,
                ));
            }
        };
        next = stored.sequence + 1;
        if walk.met() >= SCAN_MESSAGES {
            tracing::warn!(
                pipeline = %pipeline.name,
                stream = %source.dead_letter_stream,
                stopped_at = stored.sequence,
                "The dead-letter pass stopped after {SCAN_MESSAGES} messages; narrow it with --kind, --reason or --since, or replay what it found first."
            );
            break;
        }
        let Some(letter) = walk.meet(
            stored.sequence.to_string(),
            message(source, pipeline, &stored),
        ) else {
            continue;
        };
        match action {
            Action::Look => {}
            Action::Replay => {
                replay(&context, &stream, source, &stored, letter.replays + 1).await?;
            }
            Action::Discard => {
                stream
                    .delete_message(stored.sequence)
                    .await
                    .map_err(|error| {
                        request_error("discard from", &source.dead_letter_stream, error)
                    })?;
            }
        }
    }
    Ok(walk.selected())
}

/// The dead letter as the pipeline's plugin saw it: from the pipeline's stream, on the subject
/// it was consumed from, with the producer's message id.
fn message(
    source: &JetStreamConfig,
    pipeline: &PipelineConfig,
    stored: &StreamMessage,
) -> InboundMessage {
    let header = |name: &str| {
        stored
            .headers
            .get(name)
            .map(|value| value.as_str().to_string())
    };
    InboundMessage {
        pipeline: pipeline.name.clone(),
        source: KIND.to_string(),
        queue: source.stream.clone(),
        subject: header(headers::SUBJECT).unwrap_or_else(|| stored.subject.to_string()),
        body: stored.payload.to_vec(),
        headers: header_pairs(&stored.headers),
        message_id: header(headers::MESSAGE_ID),
        redelivered: false,
        delivery_count: None,
        attributes: header(headers::STREAM_SEQUENCE)
            .map(|sequence| vec![("stream-sequence".to_string(), sequence)])
            .unwrap_or_default(),
    }
}

/// Publishes dead letter `stored` to the subject it was consumed from, waits until the server
/// stored it on the pipeline's stream, then deletes it from the dead-letter stream.
async fn replay(
    context: &jetstream::Context,
    dead_letters: &stream::Stream,
    source: &JetStreamConfig,
    stored: &StreamMessage,
    replays: u64,
) -> Result<(), JetStreamError> {
    let refused = |reason: String| JetStreamError::Request {
        action: "replay",
        name: format!("{} sequence {}", source.dead_letter_stream, stored.sequence),
        reason,
    };
    let Some(subject) = stored
        .headers
        .get(headers::SUBJECT)
        .map(|value| value.as_str())
    else {
        return Err(refused(format!(
            "it has no {} header (idem did not dead-letter it), so the subject it came from is unknown",
            headers::SUBJECT
        )));
    };
    // Without a filter the consumer takes whatever the stream stores (checked below).
    if let Some(filter) = source
        .subject
        .as_deref()
        .filter(|filter| !subject_matches(filter, subject))
    {
        return Err(refused(format!(
            "its subject {subject:?} is outside {}.subject {filter:?}, so the pipeline would never consume it",
            source.table
        )));
    }
    // The producer's message id (x-idem-message-id) carried on, the replay counted.
    let mut headers = copied_headers(Some(&stored.headers));
    headers.insert(headers::REPLAYS, replays.to_string().as_str());
    // Published again after a lost confirmation, it is stored once.
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        format!(
            "{REPLAY_ID_PREFIX}{}:{}",
            source.dead_letter_stream, stored.sequence
        )
        .as_str(),
    );
    let confirmed = async {
        context
            .publish_with_headers(subject.to_string(), headers, stored.payload.clone())
            .await?
            .await
    };
    let confirmation = confirmed
        .await
        .map_err(|error| refused(format!("the server did not store the copy: {error}")))?;
    if confirmation.stream != source.stream {
        return Err(refused(format!(
            "the server stored the copy on stream {:?}, not on {}.stream {:?}: another stream captures {subject:?}",
            confirmation.stream, source.table, source.stream
        )));
    }
    match dead_letters.delete_message(stored.sequence).await {
        Ok(_) => Ok(()),
        Err(error) => Err(refused(format!(
            "the copy is on {:?} but the dead letter could not be deleted ({error}); it may be replayed twice (harmless: the claim dedups)",
            source.stream
        ))),
    }
}
