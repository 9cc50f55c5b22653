//! Outbox rows to HTTP endpoints: `POST` the payload with an `Idempotency-Key` header; any
//! 2xx confirms, a redirect does not.

use std::collections::BTreeMap;
use std::time::Duration;

use super::DeliveryError;
use crate::config::{Destination, OutboxConfig, redact_url};
use crate::store::outbox::Taken;

/// A destination's settings that cannot work: the host does not start.
#[derive(Debug, thiserror::Error)]
#[error("outbox.destinations.{destination}.{key}: {reason}")]
pub struct DestinationError {
    destination: String,
    key: &'static str,
    reason: String,
}

/// One HTTP client per HTTP destination, trusting the destination's `ca_file` alone when it
/// has one (the system's roots otherwise).
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
        // A redirect is not a delivery: following it would turn the POST into a GET to
        // somewhere else (a login page) and read its 200 as a confirmation. A 3xx is a
        // failed attempt, with the Location in the row's last error.
        let mut builder = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none());
        if let Some(ca_file) = ca_file {
            let pem = std::fs::read(ca_file).map_err(|error| {
                failed(
                    "ca_file",
                    format!("cannot read {}: {error}", ca_file.display()),
                )
            })?;
            let authorities = reqwest::Certificate::from_pem_bundle(&pem)
                .ok()
                .filter(|authorities| !authorities.is_empty())
                .ok_or_else(|| {
                    failed(
                        "ca_file",
                        format!("{} holds no PEM certificate", ca_file.display()),
                    )
                })?;
            builder = builder.tls_certs_only(authorities);
        }
        let client = builder
            .build()
            .map_err(|error| failed("url", error_chain(&error)))?;
        clients.insert(name.clone(), client);
    }
    Ok(clients)
}

/// `POST`s `row` to `url` with `client`; `Ok` on a 2xx answer.
pub(super) async fn deliver(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
    row: &Taken,
) -> Result<(), DeliveryError> {
    let mut request = client
        .post(url)
        .timeout(timeout)
        .header("Idempotency-Key", &row.idempotency_key);
    let has_content_type = row
        .headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("content-type"));
    if !has_content_type {
        request = request.header("Content-Type", "application/octet-stream");
    }
    for (name, value) in &row.headers {
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
