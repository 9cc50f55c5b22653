//! The `[outbox]` table: where `outbox` effects may go, and how the relay delivers them.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::source::rabbitmq::{ADD_AMQP, AmqpConfig};
use super::text::{Document, duration, duration_schema, interpolated, interpolated_path_option};

/// The `[outbox]` table: where `outbox` effects may go, and how the relay delivers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxConfig {
    /// Destinations by name; a plugin's `outbox` effect names one.
    pub destinations: BTreeMap<String, Destination>,
    /// Run the relay in this host (several hosts may; rows are taken with SKIP LOCKED).
    pub relay: bool,
    /// How often the relay looks for rows other hosts wrote.
    pub poll: Duration,
    /// Rows delivered per relay transaction.
    pub batch_size: NonZeroU32,
    /// Attempts before a row is parked with its last error.
    pub max_attempts: NonZeroU32,
    /// Delivered rows older than this are deleted.
    pub retention: Duration,
}

/// One `[outbox.destinations.<name>]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// `POST` the payload to `url` with an `Idempotency-Key` header; any 2xx confirms.
    Http {
        url: String,
        timeout: Duration,
        /// PEM file of certificate authorities trusted to sign an `https://` endpoint's
        /// certificate, besides the system's store.
        ca_file: Option<PathBuf>,
    },
    /// Publish to `exchange` on `broker` with publisher confirms, persistent, `mandatory`
    /// (an unroutable message is a failed attempt), `message-id` = the key.
    Amqp {
        /// The broker (the `[amqp]` table).
        broker: AmqpConfig,
        exchange: String,
        routing_key: String,
    },
}

/// The `[outbox]` table as written.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOutbox {
    /// Destinations by name; a plugin's `outbox` effect names one.
    destinations: BTreeMap<String, RawDestination>,
    /// Run the relay in this host (default `true`; several hosts may, rows are taken with
    /// SKIP LOCKED).
    #[serde(default = "default_relay")]
    relay: bool,
    /// How often the relay looks for rows other hosts wrote (default 250ms).
    #[serde(default = "default_poll", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    poll: Duration,
    /// Rows delivered per relay transaction (default 32).
    #[serde(default = "default_batch_size")]
    batch_size: NonZeroU32,
    /// Attempts before a row is parked with its last error (default 12).
    #[serde(default = "default_max_attempts")]
    max_attempts: NonZeroU32,
    /// Delivered rows older than this are deleted (default 7d).
    #[serde(default = "default_retention", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    retention: Duration,
}

/// One `[outbox.destinations.<name>]` table as written.
#[derive(Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
enum RawDestination {
    /// `POST` the payload to `url` with an `Idempotency-Key` header; any 2xx confirms.
    Http {
        #[serde(deserialize_with = "interpolated")]
        url: String,
        /// How long one delivery may take (default 10s).
        #[serde(default = "default_http_timeout", deserialize_with = "duration")]
        #[schemars(schema_with = "duration_schema")]
        timeout: Duration,
        /// For an `https://` url: PEM file of certificate authorities trusted to sign the
        /// endpoint's certificate, besides the system's store.
        #[serde(default, deserialize_with = "interpolated_path_option")]
        ca_file: Option<PathBuf>,
    },
    /// Publish to `exchange` on the `[amqp]` broker with publisher confirms, persistent,
    /// `mandatory` (an unroutable message is a failed attempt), `message-id` = the key.
    Amqp {
        exchange: String,
        #[serde(default)]
        routing_key: String,
    },
}

impl RawOutbox {
    /// The table as written, checked: HTTP destinations have an http(s) URL, and a CA file
    /// only with https, resolved against the config file's directory; AMQP destinations
    /// publish on `amqp`, the `[amqp]` table, which they need.
    pub(super) fn checked(
        table: Spanned<RawOutbox>,
        amqp: Option<&AmqpConfig>,
        document: &Document,
    ) -> Result<OutboxConfig, ConfigError> {
        let span = table.span();
        let raw = table.into_inner();
        let mut destinations = BTreeMap::new();
        for (name, destination) in raw.destinations {
            let key = |key: &str| format!("outbox.destinations.{name}.{key}");
            let checked = match destination {
                RawDestination::Http {
                    url,
                    timeout,
                    ca_file,
                } => {
                    if !url.starts_with("http://") && !url.starts_with("https://") {
                        return Err(document.at(
                            Some(span),
                            &key("url"),
                            format!("{url:?} must be an http:// or https:// URL"),
                        ));
                    }
                    if ca_file.is_some() && !url.starts_with("https://") {
                        return Err(document.at(
                            Some(span),
                            &key("ca_file"),
                            format!("only used with an https:// url, not {url:?}"),
                        ));
                    }
                    Destination::Http {
                        url,
                        timeout,
                        ca_file: ca_file.map(|path| document.resolve(&path)),
                    }
                }
                RawDestination::Amqp {
                    exchange,
                    routing_key,
                } => {
                    let broker = amqp.cloned().ok_or_else(|| {
                        document.invalid(format!(
                            "amqp: missing: outbox destination {name:?} is a RabbitMQ exchange; {ADD_AMQP}"
                        ))
                    })?;
                    Destination::Amqp {
                        broker,
                        exchange,
                        routing_key,
                    }
                }
            };
            destinations.insert(name, checked);
        }
        Ok(OutboxConfig {
            destinations,
            relay: raw.relay,
            poll: raw.poll,
            batch_size: raw.batch_size,
            max_attempts: raw.max_attempts,
            retention: raw.retention,
        })
    }
}

fn default_relay() -> bool {
    true
}

fn default_poll() -> Duration {
    Duration::from_millis(250)
}

fn default_batch_size() -> NonZeroU32 {
    NonZeroU32::new(32).expect("non-zero literal")
}

fn default_max_attempts() -> NonZeroU32 {
    NonZeroU32::new(12).expect("non-zero literal")
}

fn default_retention() -> Duration {
    Duration::from_secs(7 * 86_400)
}

fn default_http_timeout() -> Duration {
    Duration::from_secs(10)
}
