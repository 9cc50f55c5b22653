//! What waits on a pipeline's stream: pending and unacknowledged messages, the age of the
//! oldest unsettled one and the dead letters, for `idem status`, the console and the sampled
//! gauges; and how a pipeline's consumer stands (`inspect`, for `idem check`).

use std::time::Duration;

use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self};

use crate::config::JetStreamConfig;
use crate::source::{self};

use super::connect::connect;
use super::topology::{
    as_served, captures_dead_letters, check_consumer, find_consumer, find_stream, must_exist,
    not_captured,
};
use super::{JetStreamError, request_error};

/// What the server has for a source, as `idem check` and `idem status` report it; nothing is
/// created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// The stream is missing; `idem run` creates it (with `declare`).
    StreamMissing,
    /// The stream is there, the consumer is not; `idem run` creates it (with `declare`).
    ConsumerMissing { messages: u64 },
    /// Both are there and the consumer matches the config.
    Ready {
        /// Messages in the stream.
        messages: u64,
        /// Not delivered yet, and delivered but not acknowledged.
        pending: u64,
        unacknowledged: u64,
        /// Messages kept on the dead-letter stream (`None`: not created yet).
        dead_letters: Option<u64>,
    },
}

/// Looks at `source`'s stream, consumer and dead-letter stream without creating anything.
/// A refusal when something is missing that `idem run` would not create (`declare = false`),
/// or the consumer differs from the config.
/// With `max_attempts` (`idem check`), a consumer of the operator's (`declare = false`) whose
/// `max_deliver` leaves no room for them is refused, as `idem run` refuses it.
pub async fn inspect(
    source: &JetStreamConfig,
    max_attempts: Option<std::num::NonZeroU32>,
) -> Result<Found, JetStreamError> {
    let context = jetstream::new(connect(source, "idem check".into()).await?);
    let Some(stream) = find_stream(&context, &source.stream).await? else {
        if source.declare {
            return Ok(Found::StreamMissing);
        }
        return Err(must_exist(source, "stream", &source.stream));
    };
    // Looking the stream up fetched its info: no second request.
    let messages = stream.cached_info().state.messages;
    let Some(consumer) = find_consumer(&context, source).await? else {
        if source.declare {
            return Ok(Found::ConsumerMissing { messages });
        }
        return Err(must_exist(source, "consumer", &source.consumer));
    };
    check_consumer(source, &consumer)?;
    let info = consumer.cached_info();
    if let Some(max_attempts) = max_attempts {
        as_served(source, &info.config, max_attempts)?;
    }
    // A dead-letter stream that does not capture this pipeline's subject: `idem run` adds it
    // with `declare`, and refuses to start without. A failed lookup (`idem status` can go
    // without the count) shows as unknown.
    let dead_letter_stream = find_stream(&context, &source.dead_letter_stream)
        .await
        .ok()
        .flatten();
    if let Some(stream) = &dead_letter_stream
        && !source.declare
        && !captures_dead_letters(stream.cached_info(), source)
    {
        return Err(not_captured(
            source,
            &stream.cached_info().config.subjects,
            None,
        ));
    }
    let dead_letters = dead_letter_stream.map(|stream| stream.cached_info().state.messages);
    Ok(Found::Ready {
        messages,
        pending: info.num_pending,
        unacknowledged: info.num_ack_pending as u64,
        dead_letters,
    })
}

/// The consumer's pending and unacknowledged counts and the dead-letter stream's messages.
pub async fn depths(
    kept: &mut Option<async_nats::Client>,
    source: &JetStreamConfig,
) -> Result<source::Depths, JetStreamError> {
    let client = match kept.take() {
        Some(client) if client.connection_state() == async_nats::connection::State::Connected => {
            client
        }
        _ => connect(source, "idem depths".into()).await?,
    };
    let read = read_depths(&jetstream::new(client.clone()), source).await;
    if read.is_ok() {
        *kept = Some(client);
    }
    read
}

pub(super) async fn read_depths(
    context: &jetstream::Context,
    source: &JetStreamConfig,
) -> Result<source::Depths, JetStreamError> {
    let Some(mut consumer) = find_consumer(context, source).await? else {
        return Err(must_exist(source, "consumer", &source.consumer));
    };
    let info = consumer
        .info()
        .await
        .map_err(|error| request_error("read", &source.consumer, error))?
        .clone();
    let unsettled = info.num_pending + info.num_ack_pending as u64;
    let oldest_age = if unsettled == 0 {
        Duration::ZERO
    } else {
        oldest_unsettled_age(context, source, info.ack_floor.stream_sequence + 1).await?
    };
    Ok(source::Depths {
        waiting: info.num_pending,
        unacknowledged: Some(info.num_ack_pending as u64),
        dead_letters: dead_letter_count(context, source).await?,
        oldest_age: Some(oldest_age),
        ..source::Depths::default()
    })
}

/// How long ago the first message of the consumer's subjects at or after `sequence` (the one
/// past its ack floor: the oldest not settled) was stored.
pub(super) async fn oldest_unsettled_age(
    context: &jetstream::Context,
    source: &JetStreamConfig,
    sequence: u64,
) -> Result<Duration, JetStreamError> {
    let stream = context
        .get_stream_no_info(&source.stream)
        .await
        .map_err(|error| request_error("read", &source.stream, error))?;
    let oldest = stream
        .raw_message_builder()
        .sequence(sequence)
        .next_by_subject(source.subject.as_deref().unwrap_or(">"))
        .send()
        .await;
    Ok(match oldest {
        Ok(message) => {
            let stored = message.time.unix_timestamp_nanos();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_nanos() as i128);
            Duration::from_nanos(u64::try_from(now - stored).unwrap_or(0))
        }
        // Acked or removed meanwhile.
        Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => Duration::ZERO,
        Err(error) => return Err(request_error("read", &source.stream, error)),
    })
}

/// The messages on `source`'s dead-letter stream (every pipeline's that share it); `None` while
/// it does not exist.
pub(super) async fn dead_letter_count(
    context: &jetstream::Context,
    source: &JetStreamConfig,
) -> Result<Option<u64>, JetStreamError> {
    Ok(find_stream(context, &source.dead_letter_stream)
        .await?
        .map(|stream| stream.cached_info().state.messages))
}
