//! The stream, the durable consumer and the dead-letter stream a pipeline needs: found,
//! created with `declare`, or refused naming the setting; an operator's consumer served by
//! its own settings (`as_served`).

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
use async_nats::jetstream::stream::ConsumerErrorKind;
use async_nats::jetstream::{self, ErrorCode, stream};
use tracing::warn;

use crate::config::{ClaimMode, ConsumerStart, JetStreamConfig, PipelineConfig, subject_matches};

use super::{JetStreamError, request_error};

/// Stream `name`, or `None` when the server has no stream by that name.
pub(super) async fn find_stream(
    context: &jetstream::Context,
    name: &str,
) -> Result<Option<stream::Stream>, JetStreamError> {
    match context.get_stream(name).await {
        Ok(stream) => Ok(Some(stream)),
        Err(error)
            if matches!(error.kind(), GetStreamErrorKind::JetStream(ref inner)
                if inner.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
        {
            Ok(None)
        }
        Err(error) => Err(request_error("look up stream", name, error)),
    }
}

/// `source`'s durable consumer, or `None` when its stream has no consumer by that name.
pub(super) async fn find_consumer(
    context: &jetstream::Context,
    source: &JetStreamConfig,
) -> Result<Option<jetstream::consumer::Consumer<pull::Config>>, JetStreamError> {
    match context
        .get_consumer_from_stream::<pull::Config, _, _>(&source.consumer, &source.stream)
        .await
    {
        Ok(consumer) => Ok(Some(consumer)),
        Err(error)
            if matches!(error.kind(), ConsumerErrorKind::JetStream(ref inner)
                if inner.error_code() == ErrorCode::CONSUMER_NOT_FOUND) =>
        {
            Ok(None)
        }
        Err(error) => Err(request_error("look up consumer", &source.consumer, error)),
    }
}

/// The refusal for `key`'s `name` missing with `declare = false`, which idem does not create.
pub(super) fn must_exist(source: &JetStreamConfig, key: &str, name: &str) -> JetStreamError {
    JetStreamError::Refused {
        subject: format!("{}.{key} {name:?}", source.table),
        reason: "it does not exist".into(),
        setting: format!(
            "{}.{key} and declare = false: with declare = false it must exist before idem starts",
            source.table
        ),
    }
}

/// The refusal for an existing consumer that differs from `source`'s (see `differences`).
pub(super) fn check_consumer(
    source: &JetStreamConfig,
    consumer: &jetstream::consumer::Consumer<pull::Config>,
) -> Result<(), JetStreamError> {
    let differences = differences(
        &consumer.cached_info().config,
        &wanted(source),
        source.declare,
    );
    if differences.is_empty() {
        return Ok(());
    }
    Err(JetStreamError::Refused {
        subject: format!("{}.consumer {:?}", source.table, source.consumer),
        reason: format!("it exists with {}", differences.join(", ")),
        setting: format!(
            "{table}.subject, ack_wait and max_deliver: they must match the existing consumer, or name another consumer (or set declare = false to use it as it is)",
            table = source.table
        ),
    })
}

/// Makes sure stream `name` exists: created (capturing `subject`) when missing and the source
/// may declare; refused when missing and it may not, or when the server refuses to create it.
pub(super) async fn ensure_stream(
    context: &jetstream::Context,
    source: &JetStreamConfig,
    name: &str,
    subject: String,
    key: &str,
) -> Result<(), JetStreamError> {
    if find_stream(context, name).await?.is_some() {
        return Ok(());
    }
    if !source.declare {
        return Err(must_exist(source, key, name));
    }
    let created = context
        .create_stream(stream::Config {
            name: name.to_string(),
            subjects: vec![subject],
            ..stream::Config::default()
        })
        .await;
    match created {
        Ok(_) => Ok(()),
        Err(error) if matches!(error.kind(), CreateStreamErrorKind::JetStream(_)) => {
            Err(JetStreamError::Refused {
                subject: format!("{}.{key} {name:?}", source.table),
                reason: error.to_string(),
                setting: format!(
                    "{}.{key}: idem creates it when missing; its subjects must not overlap another stream's",
                    source.table
                ),
            })
        }
        Err(error) => Err(request_error("create stream", name, error)),
    }
}

/// What a dead-letter stream idem creates captures: every subject under its name when the
/// pipeline's dead-letter subject is one (the default, `<stream>_DEAD_LETTERS.<pipeline>`),
/// so every pipeline sharing it is captured from the start; otherwise that subject.
pub(super) fn dead_letter_capture(source: &JetStreamConfig) -> String {
    let prefix = format!("{}.", source.dead_letter_stream);
    if source.dead_letter_subject.starts_with(&prefix) {
        format!("{prefix}>")
    } else {
        source.dead_letter_subject.clone()
    }
}

/// Whether `stream` captures `source`'s dead-letter subject.
pub(super) fn captures_dead_letters(stream: &stream::Info, source: &JetStreamConfig) -> bool {
    stream
        .config
        .subjects
        .iter()
        .any(|filter| subject_matches(filter, &source.dead_letter_subject))
}

/// The refusal for a dead-letter stream that does not capture the pipeline's dead-letter
/// subject and may not be changed (`declare = false`), or refused the change.
pub(super) fn not_captured(
    source: &JetStreamConfig,
    subjects: &[String],
    reason: Option<String>,
) -> JetStreamError {
    JetStreamError::Refused {
        subject: format!(
            "{}.dead_letter_stream {:?}",
            source.table, source.dead_letter_stream
        ),
        reason: reason.unwrap_or_else(|| {
            format!(
                "it captures {subjects:?}, not the dead-letter subject {:?}: a dead letter could not be stored",
                source.dead_letter_subject
            )
        }),
        setting: format!(
            "{table}.dead_letter_subject and dead_letter_stream: the stream must capture the subject (idem adds it with declare = true)",
            table = source.table
        ),
    }
}

/// Makes sure the dead-letter stream exists and captures the pipeline's dead-letter subject:
/// created when missing, and, when it exists capturing only other pipelines' subjects (a
/// second pipeline on the same stream), given this one's too, with `declare`. Several hosts
/// may do this at once: each change is checked by reading the stream again.
pub(super) async fn ensure_dead_letter_stream(
    context: &jetstream::Context,
    source: &JetStreamConfig,
) -> Result<(), JetStreamError> {
    let name = &source.dead_letter_stream;
    for _ in 0..5 {
        let Some(stream) = find_stream(context, name).await? else {
            if !source.declare {
                return Err(must_exist(source, "dead_letter_stream", name));
            }
            let created = context
                .create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![dead_letter_capture(source)],
                    ..stream::Config::default()
                })
                .await;
            match created {
                Ok(_) => continue,
                // Another host created it meanwhile, capturing other subjects: look again.
                Err(error)
                    if matches!(error.kind(), CreateStreamErrorKind::JetStream(ref inner)
                        if inner.error_code() == ErrorCode::STREAM_NAME_EXIST) =>
                {
                    continue;
                }
                Err(error) if matches!(error.kind(), CreateStreamErrorKind::JetStream(_)) => {
                    return Err(not_captured(source, &[], Some(error.to_string())));
                }
                Err(error) => return Err(request_error("create stream", name, error)),
            }
        };
        let info = stream.cached_info().clone();
        if captures_dead_letters(&info, source) {
            return Ok(());
        }
        if !source.declare {
            return Err(not_captured(source, &info.config.subjects, None));
        }
        let mut config = info.config.clone();
        config.subjects.push(source.dead_letter_subject.clone());
        match context.update_stream(&config).await {
            Ok(_) => {
                tracing::info!(
                    stream = %name,
                    subject = %source.dead_letter_subject,
                    "The dead-letter stream now captures this pipeline's dead-letter subject too."
                );
            }
            Err(error) if matches!(error.kind(), CreateStreamErrorKind::JetStream(_)) => {
                return Err(not_captured(
                    source,
                    &info.config.subjects,
                    Some(error.to_string()),
                ));
            }
            Err(error) => return Err(request_error("update stream", name, error)),
        }
        // The next turn reads it again: another host's update at the same moment may have
        // replaced ours.
    }
    Err(JetStreamError::Request {
        action: "make the dead-letter stream capture",
        name: source.dead_letter_subject.clone(),
        reason: format!("{name:?} kept changing under concurrent updates"),
    })
}

/// The durable pull consumer `source` describes.
pub(super) fn wanted(source: &JetStreamConfig) -> pull::Config {
    pull::Config {
        durable_name: Some(source.consumer.clone()),
        filter_subject: source.subject.clone().unwrap_or_default(),
        ack_policy: AckPolicy::Explicit,
        ack_wait: source.ack_wait,
        max_deliver: source.max_deliver.unwrap_or(-1),
        ..pull::Config::default()
    }
}

/// How far back a consumer idem creates may start: the claim window with ledger claims
/// (`start = "window"`), whose claims are deleted past it; `None` for no limit.
pub(super) fn claim_window(
    source: &JetStreamConfig,
    pipeline: &PipelineConfig,
) -> Option<Duration> {
    match (source.start, pipeline.claim) {
        (ConsumerStart::Window, ClaimMode::Ledger) => Some(pipeline.retention.window),
        _ => None,
    }
}

/// The consumer to create for `source`: from the stream's first message, or, when the stream
/// keeps messages older than `window`, from `window` ago. A consumer created again after an
/// operator deleted it would otherwise deliver messages whose claims retention removed, and
/// apply them a second time.
pub(super) async fn consumer_to_create(
    context: &jetstream::Context,
    source: &JetStreamConfig,
    window: Option<Duration>,
) -> Result<pull::Config, JetStreamError> {
    let mut config = wanted(source);
    let Some(window) = window else {
        return Ok(config);
    };
    let Some(stream) = find_stream(context, &source.stream).await? else {
        return Ok(config);
    };
    let state = &stream.cached_info().state;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let earliest = async_nats::datetime::from_nanos(now.saturating_sub(window).as_nanos() as i128)
        .map_err(|error| request_error("compute the start of", &source.consumer, error))?;
    if state.messages > 0 && state.first_timestamp < earliest {
        warn!(
            stream = %source.stream,
            consumer = %source.consumer,
            window = ?window,
            first_message = %state.first_timestamp,
            "The stream keeps messages older than the claim window: the consumer idem creates starts at the window's start, since an older message may have been applied and no claim would recognise it (start = \"all\" delivers them)."
        );
        config.deliver_policy = DeliverPolicy::ByStartTime {
            start_time: earliest,
        };
    }
    Ok(config)
}

/// The durable pull consumer: created as configured when missing (with `declare`), starting
/// no earlier than `window` ago (see `consumer_to_create`), and refused when it exists with
/// other settings than the source's.
pub(super) async fn ensure_consumer(
    context: &jetstream::Context,
    source: &JetStreamConfig,
    window: Option<Duration>,
) -> Result<jetstream::consumer::Consumer<pull::Config>, JetStreamError> {
    let consumer = match find_consumer(context, source).await? {
        Some(consumer) => consumer,
        None if source.declare => {
            let config = consumer_to_create(context, source, window).await?;
            match context
                .create_consumer_on_stream(config, &source.stream)
                .await
            {
                Ok(consumer) => consumer,
                Err(error) if matches!(error.kind(), ConsumerErrorKind::JetStream(_)) => {
                    return Err(JetStreamError::Refused {
                        subject: format!("{}.consumer {:?}", source.table, source.consumer),
                        reason: error.to_string(),
                        setting: format!(
                            "{}.consumer, subject, ack_wait and max_deliver",
                            source.table
                        ),
                    });
                }
                Err(error) => {
                    return Err(request_error("create consumer", &source.consumer, error));
                }
            }
        }
        None => return Err(must_exist(source, "consumer", &source.consumer)),
    };
    check_consumer(source, &consumer)?;
    Ok(consumer)
}

/// The source's settings as the server's consumer applies them: with `declare = false` the
/// consumer is the operator's, and its own `ack_wait` (how often a held message is marked in
/// progress) and `max_deliver` (when a message given back would be abandoned) are the ones
/// that count. A `max_deliver` that leaves no room for `max_attempts` is refused, as the
/// configured one is.
pub(super) fn as_served(
    source: &JetStreamConfig,
    have: &jetstream::consumer::Config,
    max_attempts: std::num::NonZeroU32,
) -> Result<JetStreamConfig, JetStreamError> {
    let mut served = source.clone();
    if source.declare {
        return Ok(served);
    }
    served.ack_wait = have.ack_wait;
    served.max_deliver = (have.max_deliver > 0).then_some(have.max_deliver);
    let attempts = i64::from(max_attempts.get());
    match served.max_deliver {
        Some(max_deliver) if max_deliver <= attempts => Err(JetStreamError::Refused {
            subject: format!("{}.consumer {:?}", source.table, source.consumer),
            reason: format!(
                "it allows {max_deliver} deliveries (max_deliver), which leaves no room for max_attempts = {attempts}: a delivery is also spent by every restart, crash or late ack"
            ),
            setting: format!(
                "the consumer's max_deliver (above {attempts}, or -1 for no limit), or max_attempts of the pipeline of {}",
                source.table
            ),
        }),
        _ => Ok(served),
    }
}

/// How an existing consumer differs from the one `wanted` describes, one phrase each. Its
/// subject and ack policy always count; with `declare`, its `ack_wait` and `max_deliver` too.
pub(super) fn differences(
    have: &jetstream::consumer::Config,
    wanted: &pull::Config,
    declare: bool,
) -> Vec<String> {
    let mut differences = Vec::new();
    if have.filter_subject != wanted.filter_subject {
        differences.push(format!(
            "subject {:?} (configured {:?})",
            have.filter_subject, wanted.filter_subject
        ));
    }
    if have.ack_policy != AckPolicy::Explicit {
        differences.push(format!(
            "ack policy {:?} (idem needs explicit acks)",
            have.ack_policy
        ));
    }
    if declare && have.ack_wait != wanted.ack_wait {
        differences.push(format!(
            "ack_wait {:?} (configured {:?})",
            have.ack_wait, wanted.ack_wait
        ));
    }
    if declare && have.max_deliver != wanted.max_deliver {
        differences.push(format!(
            "max_deliver {} (configured {})",
            have.max_deliver, wanted.max_deliver
        ));
    }
    differences
}
