//! A NATS JetStream source: `[pipelines.<name>.source]` with `kind = "jetstream"`, every
//! setting of it and every check of them, and how NATS matches subjects.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::super::ConfigError;
use super::super::text::Table;
use super::super::tls::ClientTls;
use super::Start;

/// A NATS JetStream stream, read through a durable pull consumer.
#[derive(Debug, Clone)]
pub struct JetStreamConfig {
    /// NATS server URLs (`nats://host:4222`); the client fails over between them.
    pub servers: Vec<String>,
    /// Credentials, when the server asks for them.
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// A NATS credentials file (a user JWT and its NKey seed), as NGS or an operator-mode
    /// server hands out.
    pub credentials_file: Option<PathBuf>,
    /// TLS: required when set (also with a `nats://` URL), with these authorities and client
    /// certificate; a `tls://` URL alone trusts the system's store.
    pub tls: Option<ClientTls>,
    pub stream: String,
    /// The subject filter of the consumer; the stream's subjects when absent.
    pub subject: Option<String>,
    /// The durable consumer's name.
    pub consumer: String,
    /// `true`: the stream, the consumer and the dead-letter stream are created when missing
    /// (and an existing consumer must match); `false`: they must exist and are used as they are.
    pub declare: bool,
    /// How long the server waits for an ack before delivering the message again.
    pub ack_wait: Duration,
    /// Deliveries of one message the server makes at most (`None`: no limit).
    pub max_deliver: Option<i64>,
    /// Where rejected messages are published, with the reason in their headers.
    pub dead_letter_subject: String,
    /// The stream that keeps the dead letters (created with `declare`).
    pub dead_letter_stream: String,
    /// Tell the server the message is still being worked on (`+WPI`) while its handling
    /// outlives half of `ack_wait`.
    pub in_progress: bool,
    /// Where a consumer idem creates starts on the stream.
    pub start: ConsumerStart,
    /// The table these keys are written in, for messages that name a setting.
    pub table: String,
}

/// Where a consumer idem creates (the first time, or after an operator deleted it) starts on
/// its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ConsumerStart {
    /// With ledger claims, no earlier than the claim window (`retention.window`): an older
    /// message may have been applied already, and no claim is left to recognise it. Natural
    /// and `none` claims recognise what they applied for ever: they start at the first message.
    Window,
    /// At the stream's first message, whatever its age.
    All,
}

/// A JetStream source's keys as written.
pub(in crate::config) struct JetStreamKeys {
    pub servers: Option<Spanned<Vec<String>>>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    pub credentials_file: Option<PathBuf>,
    pub tls: Option<ClientTls>,
    pub stream: Option<Spanned<String>>,
    pub subject: Option<String>,
    pub consumer: Option<String>,
    pub declare: Option<bool>,
    pub ack_wait: Option<Duration>,
    pub max_deliver: Option<i64>,
    pub dead_letter_subject: Option<String>,
    pub dead_letter_stream: Option<String>,
    pub in_progress: Option<bool>,
    pub start: Option<Start>,
}

impl JetStreamKeys {
    /// Every key a JetStream source reads, in the order `set` reads them.
    pub const KEYS: [&'static str; 16] = [
        "servers",
        "user",
        "password",
        "token",
        "credentials_file",
        "tls",
        "stream",
        "subject",
        "consumer",
        "declare",
        "ack_wait",
        "max_deliver",
        "dead_letter_subject",
        "dead_letter_stream",
        "in_progress",
        "start",
    ];

    /// The keys set, by name. Every field is named here
    /// (no `..`): a new key does not compile until it is counted.
    pub fn set(&self) -> Vec<&'static str> {
        let JetStreamKeys {
            servers,
            user,
            password,
            token,
            credentials_file,
            tls,
            stream,
            subject,
            consumer,
            declare,
            ack_wait,
            max_deliver,
            dead_letter_subject,
            dead_letter_stream,
            in_progress,
            start,
        } = self;
        let set: [bool; Self::KEYS.len()] = [
            servers.is_some(),
            user.is_some(),
            password.is_some(),
            token.is_some(),
            credentials_file.is_some(),
            tls.is_some(),
            stream.is_some(),
            subject.is_some(),
            consumer.is_some(),
            declare.is_some(),
            ack_wait.is_some(),
            max_deliver.is_some(),
            dead_letter_subject.is_some(),
            dead_letter_stream.is_some(),
            in_progress.is_some(),
            start.is_some(),
        ];
        Self::KEYS
            .into_iter()
            .zip(set)
            .filter_map(|(key, set)| set.then_some(key))
            .collect()
    }

    /// The source these keys describe for pipeline `pipeline`, written in `table`.
    /// `max_attempts`, the tries of a message, is what the server's delivery limit must
    /// leave room for.
    pub fn checked(
        self,
        pipeline: &str,
        max_attempts: NonZeroU32,
        table: &Table,
    ) -> Result<JetStreamConfig, ConfigError> {
        self.check_authentication(table)?;
        self.check_delivery(max_attempts, table)?;
        let start = start(self.start, table)?;
        let stream = stream(self.stream, table)?;
        let servers = servers(self.servers, table)?;
        let tls = match self.tls {
            Some(tls) => Some(
                tls.checked(table.document)
                    .map_err(|problem| table.at(None, "tls", problem))?,
            ),
            None => None,
        };
        let consumer = self.consumer.unwrap_or_else(|| format!("idem-{pipeline}"));
        if !name_ok(&consumer) {
            return Err(table.at(
                None,
                "consumer",
                format!("{consumer:?}: a consumer name has no spaces, '.', '*', '>', '/' or '\\'"),
            ));
        }
        let dead_letter_stream = self
            .dead_letter_stream
            .unwrap_or_else(|| format!("{stream}_DEAD_LETTERS"));
        if dead_letter_stream == stream || !name_ok(&dead_letter_stream) {
            return Err(table.at(
                None,
                "dead_letter_stream",
                format!("{dead_letter_stream:?}: a stream name of its own, other than {stream:?}"),
            ));
        }
        let dead_letter_subject = self
            .dead_letter_subject
            .unwrap_or_else(|| format!("{dead_letter_stream}.{pipeline}"));
        let consumed = self
            .subject
            .clone()
            .unwrap_or_else(|| format!("{stream}.>"));
        if subject_matches(&consumed, &dead_letter_subject) {
            return Err(table.at(
                None,
                "dead_letter_subject",
                format!(
                    "{dead_letter_subject:?} is consumed by the pipeline itself (subject {consumed:?}): a dead letter would come back; name a subject outside it"
                ),
            ));
        }
        Ok(JetStreamConfig {
            servers,
            user: self.user,
            password: self.password,
            token: self.token,
            credentials_file: self
                .credentials_file
                .map(|path| table.document.resolve(&path)),
            tls,
            stream,
            subject: self.subject,
            consumer,
            declare: self.declare.unwrap_or(true),
            ack_wait: self.ack_wait.unwrap_or(DEFAULT_ACK_WAIT),
            max_deliver: self.max_deliver,
            dead_letter_subject,
            dead_letter_stream,
            in_progress: self.in_progress.unwrap_or(true),
            start,
            table: table.name.clone(),
        })
    }

    /// One way to authenticate at most, and a user with its password.
    fn check_authentication(&self, table: &Table) -> Result<(), ConfigError> {
        let ways = [
            self.user.is_some() || self.password.is_some(),
            self.token.is_some(),
            self.credentials_file.is_some(),
        ];
        if ways.iter().filter(|way| **way).count() > 1 {
            return Err(table.at(
                None,
                "credentials_file",
                "user/password, token and credentials_file are three ways to authenticate: give one",
            ));
        }
        if self.user.is_some() != self.password.is_some() {
            let missing = if self.user.is_some() {
                "password"
            } else {
                "user"
            };
            return Err(table.at(None, missing, "user and password go together"));
        }
        Ok(())
    }

    /// `ack_wait` of a second at least, and a server delivery limit above the tries.
    fn check_delivery(&self, max_attempts: NonZeroU32, table: &Table) -> Result<(), ConfigError> {
        let ack_wait = self.ack_wait.unwrap_or(DEFAULT_ACK_WAIT);
        if ack_wait < Duration::from_secs(1) {
            return Err(table.at(
                None,
                "ack_wait",
                format!("{ack_wait:?} is too short: at least 1s"),
            ));
        }
        let Some(max_deliver) = self.max_deliver else {
            return Ok(());
        };
        if max_deliver < 1 {
            return Err(table.at(
                None,
                "max_deliver",
                "at least 1 (leave it out for no limit)",
            ));
        }
        // The server counts deliveries, idem the plugin's tries: a limit that leaves no room
        // for every try would have the server abandon a message idem still means to retry.
        let attempts = i64::from(max_attempts.get());
        if max_deliver <= attempts {
            return Err(table.at(
                None,
                "max_deliver",
                format!(
                    "{max_deliver} leaves no room for max_attempts = {attempts}: a delivery is also spent by every restart, crash or late ack; set it above {attempts} (or leave it out for no limit)"
                ),
            ));
        }
        Ok(())
    }
}

/// Where a consumer idem creates starts: `window` (default) or `all`.
fn start(start: Option<Start>, table: &Table) -> Result<ConsumerStart, ConfigError> {
    match start {
        None | Some(Start::Window) => Ok(ConsumerStart::Window),
        Some(Start::All) => Ok(ConsumerStart::All),
        Some(Start::Earliest | Start::Latest) => Err(table.at(
            None,
            "start",
            "\"earliest\" and \"latest\" are Kafka's; a JetStream consumer starts at \"window\" or \"all\"",
        )),
    }
}

/// How long the server waits for an ack by default.
const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);

/// The stream consumed: given, and a valid stream name.
fn stream(stream: Option<Spanned<String>>, table: &Table) -> Result<String, ConfigError> {
    let Some(stream) = stream else {
        return Err(table.at(
            None,
            "stream",
            "missing: the JetStream stream this pipeline consumes",
        ));
    };
    let span = Some(stream.span());
    let stream = stream.into_inner();
    if !name_ok(&stream) {
        return Err(table.at(
            span,
            "stream",
            format!(
                "{stream:?}: a stream name is 1 to 255 bytes without spaces, '.', '*', '>', '/' or '\\'"
            ),
        ));
    }
    Ok(stream)
}

/// The NATS servers: at least one.
fn servers(
    servers: Option<Spanned<Vec<String>>>,
    table: &Table,
) -> Result<Vec<String>, ConfigError> {
    match servers {
        Some(servers) if servers.get_ref().is_empty() => Err(table.at(
            Some(servers.span()),
            "servers",
            "give at least one NATS server URL",
        )),
        Some(servers) => Ok(servers.into_inner()),
        None => Err(table.at(
            None,
            "servers",
            "missing: the NATS server URLs, e.g. [\"nats://127.0.0.1:4222\"]",
        )),
    }
}

/// Whether `name` may name a stream or a consumer: 1 to 255 bytes, no spaces or `.*>/\`.
fn name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name
            .chars()
            .any(|character| character.is_whitespace() || ".*>/\\".contains(character))
}

/// Whether NATS subject `subject` is matched by `filter` (`*` one token, `>` the rest).
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for token in filter.split('.') {
        match (token, subject_tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (token, Some(other)) if token == other => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}
