//! Connecting to NATS as `[...source]` says: servers, credentials, TLS (the files mapped as
//! every source takes them), the connection's name; refusals that no retry fixes named by
//! their setting.

use async_nats::{ConnectErrorKind, ConnectOptions};

use crate::config::{JetStreamConfig, redact_url};
use crate::tls;

use super::{JetStreamError, REQUEST_TIMEOUT};

/// The settings a JetStream source's TLS files are named by.
pub(super) const TLS_FILES: tls::FileSettings = tls::FileSettings {
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
pub(super) fn tls_setting(table: &str) -> String {
    format!(
        "{table}.tls and the host names in {table}.servers: the server's certificate must be signed by an authority trusted here (the system's store or ca_file) and name the host; a server that asks for a client certificate needs cert_file and key_file it trusts"
    )
}
