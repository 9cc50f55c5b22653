//! Opening a connection to RabbitMQ: TLS from `[amqp.tls]`, a bound on how long it may take,
//! and the verdict on a failure: a refusal no retry can fix (credentials, vhost, TLS) or an
//! outage to wait out.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::tcp::{AMQPUriTcpExt, RustlsConnector};
use lapin::types::LongString;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

use super::AmqpError;
use crate::config::{AmqpConfig, ClientTls, redact_url};
use crate::tls;

/// How long opening a connection (TCP, TLS, AMQP handshake) may take before it counts as a
/// failed attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// AMQP reply codes that mean the operator's configuration is wrong.
pub(crate) const ACCESS_REFUSED: u16 = 403;
pub(crate) const NOT_FOUND: u16 = 404;
pub(crate) const PRECONDITION_FAILED: u16 = 406;
const INVALID_PATH: u16 = 402;
const NOT_ALLOWED: u16 = 530;

const TLS_SETTINGS: &str =
    "[amqp.tls] ca_file, cert_file and key_file, and the host name in [amqp] url";

/// How long a node may stay silent while connecting before the next one is tried beside it.
const NEXT_NODE_AFTER: Duration = Duration::from_secs(2);

/// Connects to the broker named by `config`, as `name` (shown in the management UI): to the
/// first of its nodes (`[amqp] url`, one or a list) that answers. The nodes are tried in
/// order; one that fails moves on to the next at once, one that stays silent (a dead host
/// whose packets vanish) has the next tried beside it after [`NEXT_NODE_AFTER`], and the
/// first to answer wins. A refusal (credentials, vhost, TLS) is the same on every node of a
/// cluster and ends the attempt; when no node answers, the last outage is the error.
pub async fn connect(config: &AmqpConfig, name: String) -> Result<Connection, AmqpError> {
    let mut waiting = config.urls.iter();
    let mut attempts = FuturesUnordered::new();
    let mut outage = None;
    loop {
        if attempts.is_empty() {
            match waiting.next() {
                Some(url) => attempts.push(connect_to(url, config.tls.as_ref(), name.clone())),
                None => break,
            }
        }
        tokio::select! {
            finished = attempts.next() => match finished {
                Some(Ok(connection)) => return Ok(connection),
                Some(Err(refused @ AmqpError::Refused { .. })) => return Err(refused),
                Some(Err(error)) => {
                    tracing::debug!(%error, "A RabbitMQ node did not answer; trying the next.");
                    outage = Some(error);
                    if let Some(url) = waiting.next() {
                        attempts.push(connect_to(url, config.tls.as_ref(), name.clone()));
                    }
                }
                None => {}
            },
            () = tokio::time::sleep(NEXT_NODE_AFTER), if waiting.len() > 0 => {
                if let Some(url) = waiting.next() {
                    attempts.push(connect_to(url, config.tls.as_ref(), name.clone()));
                }
            }
        }
    }
    Err(outage.unwrap_or_else(|| AmqpError::Refused {
        subject: "the connection to RabbitMQ".into(),
        reason: "no node to connect to".into(),
        setting: "[amqp] url".into(),
    }))
}

/// Connects to the one node at `url`: TCP, then (`amqps://`) TLS with idem's trust policy,
/// then the AMQP handshake.
async fn connect_to(
    url: &str,
    tls: Option<&ClientTls>,
    name: String,
) -> Result<Connection, AmqpError> {
    let endpoint = redact_url(url);
    let refused = |reason: String, setting: &str| AmqpError::Refused {
        subject: format!("the connection to {endpoint}"),
        reason,
        setting: setting.into(),
    };
    let uri: AMQPUri = url
        .parse()
        .map_err(|reason: String| refused(reason, "[amqp] url"))?;
    let connector = match uri.scheme {
        AMQPScheme::AMQPS => Some(RustlsConnector::from(Arc::new(
            tls::broker_config(tls, &TLS_FILES)
                .map_err(|error| refused(error.to_string(), TLS_SETTINGS))?,
        ))),
        AMQPScheme::AMQP => None,
    };
    let properties = ConnectionProperties::default().with_connection_name(LongString::from(name));
    let runtime = lapin::runtime::default_runtime().map_err(|source| AmqpError::Connect {
        endpoint: endpoint.clone(),
        source,
    })?;
    let connecting = Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, runtime| {
            let tcp = AMQPUri {
                scheme: AMQPScheme::AMQP,
                ..uri.clone()
            };
            let stream = tcp.connect_async(&runtime).await?;
            Ok(match &connector {
                Some(connector) => stream.into_rustls(connector, &uri.authority.host).await?,
                None => stream,
            })
        },
        properties,
    );
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(source)) => Err(match refused_setting(&source) {
            Some(setting) => refused(source.to_string(), setting),
            None => AmqpError::Connect { endpoint, source },
        }),
        Err(_elapsed) => Err(AmqpError::Timeout {
            endpoint,
            after: CONNECT_TIMEOUT,
        }),
    }
}

/// The settings `[amqp.tls]`'s files are named by.
const TLS_FILES: tls::FileSettings = tls::FileSettings {
    roots: "[amqp.tls] ca_file",
    cert: "[amqp.tls] cert_file",
    key: "[amqp.tls] key_file",
};

/// The setting to change when connecting failed in a way no retry can fix; `None` for an
/// outage (refused or unreachable address, a broker restarting), which is retried.
fn refused_setting(error: &lapin::Error) -> Option<&'static str> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp_error) => {
            let text = amqp_error.get_message().as_str();
            // "vhost / is down" (recovering) and connection limits pass; the rest is config.
            let passing = text.contains("is down") || text.contains("limit");
            match amqp_error.get_id() {
                ACCESS_REFUSED => Some("the user and password in [amqp] url"),
                NOT_ALLOWED | INVALID_PATH if !passing => Some(
                    "the vhost in [amqp] url (it must exist and the user needs access to it; `%2f` is `/`)",
                ),
                _ => None,
            }
        }
        lapin::ErrorKind::IOError(io_error) if tls::carries_tls_error(io_error) => {
            Some(TLS_SETTINGS)
        }
        lapin::ErrorKind::InvalidProtocolVersion(_) => {
            Some("[amqp] url (not an AMQP 0-9-1 broker)")
        }
        _ => None,
    }
}

/// The broker's reply code and text, when `error` is one.
pub(crate) fn reply(error: &lapin::Error) -> Option<(u16, String)> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp_error) => {
            Some((amqp_error.get_id(), amqp_error.get_message().to_string()))
        }
        _ => None,
    }
}
