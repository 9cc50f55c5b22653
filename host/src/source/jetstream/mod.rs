//! NATS JetStream through async-nats: connect, make sure the stream, the durable pull consumer
//! and the dead-letter stream are there as configured, consume, settle.
//!
//! Architecture invariant: an ack is sent only when `process` says so, after commit, and is
//! confirmed by the server (a double ack); a rejected message is stored on the dead-letter
//! subject (the server confirmed it) before it is terminated. The server's confirmation of an
//! ack says only that it got it, not that this delivery was still current: a delivery that
//! outlived `ack_wait` may have been delivered again, and the claim makes that copy a
//! duplicate.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind, PublishErrorKind};
use async_nats::jetstream::stream::{ConsumerErrorKind, RawMessageErrorKind};
use async_nats::jetstream::{self, AckKind, ErrorCode, stream};
use async_nats::{ConnectErrorKind, ConnectOptions, HeaderMap};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

pub mod check;
pub mod dead_letters;

use crate::backoff::Backoff;
use crate::config::{
    ClaimMode, ConsumerStart, JetStreamConfig, PipelineConfig, SourceConfig, redact_url,
    subject_matches,
};
use crate::message::InboundMessage;
use crate::source::{self, Delivery, Source, SourceError, headers, unix_seconds};
use crate::tls;

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

/// The settings a JetStream source's TLS files are named by.
const TLS_FILES: tls::FileSettings = tls::FileSettings {
    roots: "tls.ca_file",
    cert: "tls.cert_file",
    key: "tls.key_file",
};

/// Connects to `source`'s servers, with its credentials and TLS settings, named for `purpose`.
pub async fn connect(
    source: &JetStreamConfig,
    purpose: String,
) -> Result<async_nats::Client, JetStreamError> {
    let table = &source.table;
    let mut options = ConnectOptions::new()
        .name(purpose)
        .connection_timeout(REQUEST_TIMEOUT)
        .request_timeout(Some(REQUEST_TIMEOUT));
    if let (Some(user), Some(password)) = (&source.user, &source.password) {
        options = options.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &source.token {
        options = options.token(token.clone());
    }
    if let Some(path) = &source.credentials_file {
        options =
            options
                .credentials_file(path)
                .await
                .map_err(|error| JetStreamError::Refused {
                    subject: format!("{table}.credentials_file {}", path.display()),
                    reason: error.to_string(),
                    setting: format!(
                        "{table}.credentials_file: a NATS .creds file (user JWT and NKey seed)"
                    ),
                })?;
    }
    // Always idem's trust policy, also for a server that asks for TLS unasked.
    let config = tls::broker_config(source.tls.as_ref(), &TLS_FILES).map_err(|error| {
        JetStreamError::Refused {
            subject: format!("{table}.tls"),
            reason: error.to_string(),
            setting: format!("{table}.tls: ca_file, cert_file and key_file"),
        }
    })?;
    options = options
        .require_tls(source.tls.is_some())
        .tls_client_config(config);
    let servers = source
        .servers
        .iter()
        .map(|server| redact_url(server))
        .collect::<Vec<_>>()
        .join(", ");
    let refused = |error: &async_nats::ConnectError, setting: String| JetStreamError::Refused {
        subject: format!("the connection to {servers}"),
        reason: error.to_string(),
        setting,
    };
    options
        .connect(source.servers.clone())
        .await
        .map_err(|error| match error.kind() {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => refused(
                &error,
                format!("{table}.user and password, token or credentials_file"),
            ),
            ConnectErrorKind::ServerParse => refused(
                &error,
                format!(
                    "{table}.servers: nats:// or tls:// URLs of servers this host can speak to"
                ),
            ),
            // The handshake's verdict (an untrusted or mismatched certificate, a client
            // certificate the server wants) arrives as a TLS error or as an I/O error carrying
            // one: a configuration fault. An I/O error without one is a network failure.
            ConnectErrorKind::Tls => refused(&error, tls_setting(table)),
            _ if tls::chain_carries_tls_error(&error) => refused(&error, tls_setting(table)),
            _ => JetStreamError::Connect {
                servers: servers.clone(),
                reason: error.to_string(),
            },
        })
}

/// The settings a failed TLS handshake names.
fn tls_setting(table: &str) -> String {
    format!(
        "{table}.tls and the host names in {table}.servers: the server's certificate must be signed by an authority trusted here (the system's store or ca_file) and name the host; a server that asks for a client certificate needs cert_file and key_file it trusts"
    )
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

/// How long `give_back` waits for the next message the pull holds: they are in memory, so a
/// wait this long means there are no more.
const GIVE_BACK_WAIT: Duration = Duration::from_millis(200);

/// The retried messages a host remembers the tries of at most; past it, it forgets them all
/// (they start again at try 1).
const REMEMBERED_TRIES: usize = 100_000;

impl Route {
    fn next_try(&self, stream_sequence: u64) -> u32 {
        let tries = self.tries.lock().expect("tries");
        tries.get(&stream_sequence).copied().unwrap_or(1)
    }

    fn record_try(&self, stream_sequence: u64, attempt: u32) {
        let mut tries = self.tries.lock().expect("tries");
        if tries.len() >= REMEMBERED_TRIES {
            tries.clear();
        }
        tries.insert(stream_sequence, attempt);
    }

    fn forget(&self, stream_sequence: u64) {
        self.tries.lock().expect("tries").remove(&stream_sequence);
    }
}

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
struct Ticker(tokio::task::JoinHandle<()>);

impl Drop for Ticker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

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

/// Stream `name`, or `None` when the server has no stream by that name.
async fn find_stream(
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
async fn find_consumer(
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
fn must_exist(source: &JetStreamConfig, key: &str, name: &str) -> JetStreamError {
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
fn check_consumer(
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
async fn ensure_stream(
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
fn dead_letter_capture(source: &JetStreamConfig) -> String {
    let prefix = format!("{}.", source.dead_letter_stream);
    if source.dead_letter_subject.starts_with(&prefix) {
        format!("{prefix}>")
    } else {
        source.dead_letter_subject.clone()
    }
}

/// Whether `stream` captures `source`'s dead-letter subject.
fn captures_dead_letters(stream: &stream::Info, source: &JetStreamConfig) -> bool {
    stream
        .config
        .subjects
        .iter()
        .any(|filter| subject_matches(filter, &source.dead_letter_subject))
}

/// The refusal for a dead-letter stream that does not capture the pipeline's dead-letter
/// subject and may not be changed (`declare = false`), or refused the change.
fn not_captured(
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
async fn ensure_dead_letter_stream(
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

/// A dead letter found no stream: another pipeline's host, updating the shared dead-letter
/// stream from an earlier reading of it, may have dropped this pipeline's subject after this
/// host checked it. Makes the stream capture the subject again (with `declare`); returns
/// whether it now does.
async fn recapture_dead_letters(route: &Route) -> bool {
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

/// The durable pull consumer `source` describes.
fn wanted(source: &JetStreamConfig) -> pull::Config {
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
fn claim_window(source: &JetStreamConfig, pipeline: &PipelineConfig) -> Option<Duration> {
    match (source.start, pipeline.claim) {
        (ConsumerStart::Window, ClaimMode::Ledger) => Some(pipeline.retention.window),
        _ => None,
    }
}

/// The consumer to create for `source`: from the stream's first message, or, when the stream
/// keeps messages older than `window`, from `window` ago. A consumer created again after an
/// operator deleted it would otherwise deliver messages whose claims retention removed, and
/// apply them a second time.
async fn consumer_to_create(
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
async fn ensure_consumer(
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
fn as_served(
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
fn differences(
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

async fn read_depths(
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
    })
}

/// How long ago the first message of the consumer's subjects at or after `sequence` (the one
/// past its ack floor: the oldest not settled) was stored.
async fn oldest_unsettled_age(
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
async fn dead_letter_count(
    context: &jetstream::Context,
    source: &JetStreamConfig,
) -> Result<Option<u64>, JetStreamError> {
    Ok(find_stream(context, &source.dead_letter_stream)
        .await?
        .map(|stream| stream.cached_info().state.messages))
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
    /// (given back, it would be abandoned: `Delivery::requeue`).
    async fn give_back(&mut self) -> usize {
        let mut given = 0;
        for _ in 0..self.prefetch {
            let Ok(Some(Ok(original))) =
                tokio::time::timeout(GIVE_BACK_WAIT, self.messages.next()).await
            else {
                break;
            };
            if let Ok(received) = self.receive(original)
                && received.give_back().await
            {
                given += 1;
            }
        }
        given
    }

    async fn close(self) {
        drop(self.messages);
        if let Err(error) = self.client.drain().await {
            tracing::debug!(%error, "Draining the NATS connection failed.");
        }
    }
}

impl Session {
    fn receive(&self, original: jetstream::Message) -> Result<Received, SourceError> {
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
fn producer_message_id(headers: &HeaderMap) -> Option<String> {
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
fn copied_headers(headers: Option<&HeaderMap>) -> HeaderMap {
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
        headers.insert(headers::REASON, headers::reason_text(reason).as_str());
        headers.insert(headers::ERROR_KIND, error_kind);
        headers.insert(headers::PIPELINE, route.pipeline.as_str());
        headers.insert(headers::QUEUE, route.source.stream.as_str());
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
