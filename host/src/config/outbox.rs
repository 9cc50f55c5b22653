//! The `[outbox]` table: where `outbox` effects may go, and how the relay delivers them.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::text::{Document, duration, duration_schema, interpolated, interpolated_path_option};

/// The `[outbox]` table: where `outbox` effects may go, and how the relay delivers them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    /// Destinations by name; a plugin's `outbox` effect names one.
    pub destinations: BTreeMap<String, Destination>,
    /// Run the relay in this host (several hosts may; rows are taken with SKIP LOCKED).
    #[serde(default = "default_relay")]
    pub relay: bool,
    /// How often the relay looks for rows other hosts wrote.
    #[serde(default = "default_poll", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub poll: Duration,
    /// Rows delivered per relay transaction.
    #[serde(default = "default_batch_size")]
    pub batch_size: NonZeroU32,
    /// Attempts before a row is parked with its last error.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: NonZeroU32,
    /// Delivered rows older than this are deleted.
    #[serde(default = "default_retention", deserialize_with = "duration")]
    #[schemars(schema_with = "duration_schema")]
    pub retention: Duration,
}

/// One `[outbox.destinations.<name>]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Destination {
    /// `POST` the payload to `url` with an `Idempotency-Key` header; any 2xx confirms.
    Http {
        #[serde(deserialize_with = "interpolated")]
        url: String,
        #[serde(default = "default_http_timeout", deserialize_with = "duration")]
        #[schemars(schema_with = "duration_schema")]
        timeout: Duration,
        /// For an `https://` url: PEM file of the only certificate authorities trusted to
        /// sign the endpoint's certificate (default: the system's roots).
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

impl OutboxConfig {
    /// The table as written, checked: HTTP destinations have an http(s) URL, and a CA file
    /// only with https, resolved against the config file's directory.
    pub(super) fn checked(
        table: Spanned<OutboxConfig>,
        document: &Document,
    ) -> Result<OutboxConfig, ConfigError> {
        let span = table.span();
        let mut outbox = table.into_inner();
        for (name, destination) in &mut outbox.destinations {
            let Destination::Http { url, ca_file, .. } = destination else {
                continue;
            };
            let key = |key: &str| format!("outbox.destinations.{name}.{key}");
            if !url.starts_with("http://") && !url.starts_with("https://") {
                return Err(document.at(
                    Some(span),
                    &key("url"),
                    format!("{url:?} must be an http:// or https:// URL"),
                ));
            }
            if let Some(ca_file) = ca_file {
                if !url.starts_with("https://") {
                    return Err(document.at(
                        Some(span),
                        &key("ca_file"),
                        format!("only used with an https:// url, not {url:?}"),
                    ));
                }
                *ca_file = document.resolve(ca_file);
            }
        }
        Ok(outbox)
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
