//! Outbox rows to HTTP endpoints: `POST` the payload with an `Idempotency-Key` header; any
//! 2xx confirms, a redirect does not.

use std::collections::BTreeMap;
use std::time::Duration;

use super::DeliveryError;
use crate::config::{Destination, OutboxConfig, redact_url};
use crate::store::outbox::Taken;
use crate::tls;

/// The settings an HTTP destination's TLS files are named by (it presents no certificate).
const TLS_FILES: tls::FileSettings = tls::FileSettings {
    roots: "ca_file",
    cert: "",
    key: "",
};

/// A destination's settings that cannot work: the host does not start.
#[derive(Debug, thiserror::Error)]
#[error("outbox.destinations.{destination}.{key}: {reason}")]
pub struct DestinationError {
    destination: String,
    key: &'static str,
    reason: String,
}

/// One HTTP client per HTTP destination, trusting idem's authorities: the system's store
/// and the destination's `ca_file` (see `tls::authorities`).
pub fn http_clients(
    config: &OutboxConfig,
) -> Result<BTreeMap<String, reqwest::Client>, DestinationError> {
    let mut clients = BTreeMap::new();
    for (name, destination) in &config.destinations {
        let Destination::Http { ca_file, .. } = destination else {
            continue;
        };
        let failed = |key, reason: String| DestinationError {
            destination: name.clone(),
            key,
            reason,
        };
        let tls = tls::client_config(tls::Verify::Full, ca_file.as_deref(), None, &TLS_FILES)
            .map_err(|error| failed("ca_file", error.to_string()))?;
        // A redirect is not a delivery: following it would turn the POST into a GET to
        // somewhere else (a login page) and read its 200 as a confirmation. A 3xx is a
        // failed attempt, with the Location in the row's last error.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(|error| failed("url", error_chain(&error)))?;
        clients.insert(name.clone(), client);
    }
    Ok(clients)
}

/// `POST`s `row` with `headers` to `url` with `client`; `Ok` on a 2xx answer.
pub(super) async fn deliver(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
    row: &Taken,
    headers: &[(String, String)],
) -> Result<(), DeliveryError> {
    let mut request = client
        .post(url)
        .timeout(timeout)
        .header("Idempotency-Key", &row.idempotency_key);
    let has_content_type = headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("content-type"));
    if !has_content_type {
        request = request.header("Content-Type", "application/octet-stream");
    }
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let response = request
        .body(row.payload.clone())
        .send()
        .await
        .map_err(|error| DeliveryError::Unreachable {
            url: redact_url(url),
            reason: error_chain(&error),
        })?;
    let status = response.status();
    if status.is_success() {
        Ok(())
    } else if status.is_redirection() {
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|location| location.to_str().ok())
            .unwrap_or("no Location");
        Err(DeliveryError::Redirected {
            url: redact_url(url),
            status,
            location: redact_url(location),
        })
    } else {
        Err(DeliveryError::Refused {
            url: redact_url(url),
            status,
        })
    }
}

/// An error with its causes, which for a TLS failure name the certificate problem.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
