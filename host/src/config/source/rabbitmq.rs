//! A RabbitMQ source: the `[amqp]` broker table, and a pipeline's queue
//! (`[pipelines.<name>.source]` with `kind = "rabbitmq"`, or the older keys beside it in the
//! pipeline's table).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::super::ConfigError;
use super::super::text::{Document, Table, interpolated_one_or_many, redact_url};
use super::super::tls::ClientTls;

/// The `[amqp]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AmqpConfig {
    /// An `amqp://` or `amqps://` (TLS) URL, vhost included (`%2f` for `/`); or, for a
    /// cluster, a list of them, one per node: idem connects to the first that answers, and
    /// to another when its node goes away.
    #[serde(rename = "url", deserialize_with = "interpolated_one_or_many")]
    #[schemars(rename = "url", with = "OneOrMany")]
    pub urls: Vec<String>,
    /// TLS settings for an `amqps://` URL.
    #[serde(default)]
    pub tls: Option<ClientTls>,
}

/// A RabbitMQ queue and its dead-letter queue, on its broker.
#[derive(Debug, Clone)]
pub struct RabbitMqConfig {
    /// The broker (the `[amqp]` table).
    pub broker: AmqpConfig,
    pub queue: String,
    /// Where rejected messages go, with the reason in their headers.
    pub dead_letter_queue: String,
    /// The queue's type when idem declares it (and its dead-letter queue).
    pub queue_type: QueueType,
    /// Extra `x-…` arguments the queue is declared with (`x-delivery-limit`, `x-max-length`…).
    pub queue_arguments: BTreeMap<String, QueueArgument>,
    /// `false`: the queue belongs to infrastructure code; idem checks it exists and never
    /// declares or changes it.
    pub declare: bool,
    /// The table these keys are written in (`pipelines.<name>.source`, or `pipelines.<name>`
    /// in the older form), so a message naming a setting names it where it is.
    pub table: String,
}

/// A RabbitMQ queue type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// A single-node queue (RabbitMQ's default).
    #[default]
    Classic,
    /// A replicated Raft queue, with a delivery limit; what replicated setups use.
    Quorum,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// One `queue_arguments` value, as TOML writes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum QueueArgument {
    Integer(i64),
    Boolean(bool),
    Text(String),
}

/// `url` as `idem schema` describes it: one URL, or a list of them.
#[derive(JsonSchema)]
#[serde(untagged)]
#[expect(dead_code, reason = "a shape for the schema, never built")]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl AmqpConfig {
    /// The broker's addresses for logs and errors, without credentials.
    pub fn endpoints(&self) -> String {
        self.urls
            .iter()
            .map(|url| redact_url(url))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The table as written, checked: at least one AMQP URL, all of them TLS or none, TLS
    /// settings only with `amqps://`, its files resolved against the config file's directory.
    pub(in crate::config) fn checked(
        table: Spanned<AmqpConfig>,
        document: &Document,
    ) -> Result<AmqpConfig, ConfigError> {
        let span = Some(table.span());
        let mut amqp = table.into_inner();
        if amqp.urls.is_empty() {
            return Err(document.at(span, "amqp.url", "give at least one AMQP URL"));
        }
        let mut schemes = Vec::with_capacity(amqp.urls.len());
        for url in &amqp.urls {
            let uri: lapin::uri::AMQPUri = url.parse().map_err(|error| {
                document.at(
                    span.clone(),
                    "amqp.url",
                    format!("{:?} is not an AMQP URL: {error}", redact_url(url)),
                )
            })?;
            schemes.push(matches!(uri.scheme, lapin::uri::AMQPScheme::AMQPS));
        }
        let secure = schemes[0];
        if schemes.iter().any(|scheme| *scheme != secure) {
            return Err(document.at(
                span,
                "amqp.url",
                "the nodes of one broker are all amqps:// (TLS) or all amqp://",
            ));
        }
        if let Some(tls) = amqp.tls.take() {
            if !secure {
                return Err(document.at(
                    span,
                    "amqp.tls",
                    format!("set, but url {:?} is not amqps:// (TLS)", amqp.endpoints()),
                ));
            }
            amqp.tls = Some(
                tls.checked(document)
                    .map_err(|problem| document.at(span, "amqp.tls", problem))?,
            );
        }
        Ok(amqp)
    }
}

/// How to mend a missing `[amqp]` table, for errors.
pub(in crate::config) const ADD_AMQP: &str = "add [amqp] with url = \"amqp://…\"";

/// A RabbitMQ source's keys, from `[pipelines.<name>.source]` or the older form.
pub(in crate::config) struct RabbitMqKeys {
    pub queue: Option<Spanned<String>>,
    pub dead_letter_queue: Option<String>,
    pub queue_type: Option<QueueType>,
    pub queue_arguments: Option<Spanned<BTreeMap<String, QueueArgument>>>,
    pub declare: Option<bool>,
}

impl RabbitMqKeys {
    /// Every key of a RabbitMQ source, in the order `set` reads them.
    pub const KEYS: [&'static str; 5] = [
        "queue",
        "dead_letter_queue",
        "queue_type",
        "queue_arguments",
        "declare",
    ];

    /// The keys that are set, by name. Every field is named here (no `..`): a new key does
    /// not compile until it is counted.
    pub fn set(&self) -> Vec<&'static str> {
        let RabbitMqKeys {
            queue,
            dead_letter_queue,
            queue_type,
            queue_arguments,
            declare,
        } = self;
        let set: [bool; Self::KEYS.len()] = [
            queue.is_some(),
            dead_letter_queue.is_some(),
            queue_type.is_some(),
            queue_arguments.is_some(),
            declare.is_some(),
        ];
        Self::KEYS
            .into_iter()
            .zip(set)
            .filter_map(|(key, set)| set.then_some(key))
            .collect()
    }

    /// The source these keys describe, written in `table`, on `broker` (the `[amqp]` table;
    /// `None` when the file has none, which this source needs).
    pub fn checked(
        self,
        table: &Table,
        broker: Option<&AmqpConfig>,
    ) -> Result<RabbitMqConfig, ConfigError> {
        let Some(queue) = self.queue else {
            return Err(table.at(
                None,
                "queue",
                "missing: the RabbitMQ queue this pipeline consumes",
            ));
        };
        let span = Some(queue.span());
        let queue = queue.into_inner().trim().to_string();
        if queue.is_empty() || queue.len() > 255 {
            return Err(table.at(span, "queue", "queue name must be 1 to 255 bytes"));
        }
        let dead_letter_queue = self
            .dead_letter_queue
            .unwrap_or_else(|| format!("{queue}.dead-letter"));
        if dead_letter_queue == queue {
            return Err(table.at(
                span,
                "dead_letter_queue",
                format!("must differ from the queue {queue:?}"),
            ));
        }
        let declare = self.declare.unwrap_or(true);
        let queue_arguments = match self.queue_arguments {
            Some(arguments) => {
                let span = Some(arguments.span());
                for argument in arguments.get_ref().keys() {
                    if !argument.starts_with("x-") || argument == "x-queue-type" {
                        return Err(table.at(
                            span,
                            "queue_arguments",
                            format!(
                                "{argument:?}: queue arguments are RabbitMQ's `x-…` names; the type is set with queue_type"
                            ),
                        ));
                    }
                }
                if !declare && !arguments.get_ref().is_empty() {
                    return Err(table.at(
                        span,
                        "queue_arguments",
                        "with declare = false idem never declares the queue, so its arguments are the infrastructure's to set; remove queue_arguments",
                    ));
                }
                arguments.into_inner()
            }
            None => BTreeMap::new(),
        };
        let broker = broker.cloned().ok_or_else(|| {
            table.document.invalid(format!(
                "amqp: missing: [{}] consumes a RabbitMQ queue; {ADD_AMQP}",
                table.name
            ))
        })?;
        Ok(RabbitMqConfig {
            broker,
            queue,
            dead_letter_queue,
            queue_type: self.queue_type.unwrap_or_default(),
            queue_arguments,
            declare,
            table: table.name.clone(),
        })
    }
}
