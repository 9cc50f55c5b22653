//! The `[http]` table: the endpoint for metrics, health, the admin API and the console, and
//! a listener for metrics and health alone.

use std::net::SocketAddr;

use schemars::JsonSchema;
use serde::Deserialize;
use toml::Spanned;

use super::ConfigError;
use super::text::{Document, interpolated_option};

/// The `[http]` table.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address to listen on; loopback by default.
    #[serde(default = "default_listen")]
    #[schemars(with = "String")]
    pub listen: SocketAddr,
    /// Bearer token (at least 32 characters) required by every action on `/admin/…`, and by
    /// every read when `listen` is not a loopback address; mandatory then.
    #[serde(default, deserialize_with = "interpolated_option")]
    pub admin_token: Option<String>,
    /// Host names a request may be addressed to (its `Host`), besides IP addresses and
    /// `localhost`: the names this endpoint is reached by (`"*"`: any). Other names are
    /// refused, so a page whose domain was rebound to this address gets nothing.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Serve the operator console at `/` (default `true`): pipelines, dead letters, outbox.
    #[serde(default = "default_console")]
    pub console: bool,
    /// A second address serving only `/metrics`, `/healthz` and `/readyz` (never behind the
    /// admin token, on any address): for a Prometheus scrape and a kubelet's probes from the
    /// network while `listen` and the admin API stay on loopback. None by default.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub metrics_listen: Option<SocketAddr>,
}

impl HttpConfig {
    /// The table as written, checked: an empty token is none, and a listener beyond loopback
    /// needs one.
    pub(super) fn checked(
        table: Spanned<HttpConfig>,
        document: &Document,
    ) -> Result<HttpConfig, ConfigError> {
        let span = table.span();
        let mut http = table.into_inner();
        http.admin_token = http.admin_token.filter(|token| !token.is_empty());
        if let Some(token) = &http.admin_token
            && token.chars().count() < MIN_TOKEN_LENGTH
        {
            return Err(document.at(
                Some(span),
                "http.admin_token",
                format!(
                    "at least {MIN_TOKEN_LENGTH} characters (this one has {}); `openssl rand -hex 32` makes one",
                    token.chars().count()
                ),
            ));
        }
        if let Some(bad) = http
            .hosts
            .iter()
            .find(|name| name.is_empty() || name.contains([':', '/', ' ', '[', ']']))
        {
            return Err(document.at(
                Some(span),
                "http.hosts",
                format!("{bad:?} is not a host name (no scheme, port or path: \"idem.internal\")"),
            ));
        }
        if http.metrics_listen == Some(http.listen) {
            return Err(document.at(
                Some(span),
                "http.metrics_listen",
                format!(
                    "{} is http.listen too: give the metrics listener an address (or port) of its own, or leave it out (listen serves /metrics as well)",
                    http.listen
                ),
            ));
        }
        if !http.listen.ip().is_loopback() && http.admin_token.is_none() {
            return Err(document.at(
                Some(span),
                "http.admin_token",
                format!(
                    "required when http.listen ({}) is not a loopback address (to serve only /metrics, /healthz and /readyz beyond loopback, keep listen on loopback and set http.metrics_listen, which needs no token)",
                    http.listen
                ),
            ));
        }
        Ok(http)
    }
}

/// The shortest admin token taken: 32 characters (128 bits as hex).
pub const MIN_TOKEN_LENGTH: usize = 32;

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}

fn default_console() -> bool {
    true
}
