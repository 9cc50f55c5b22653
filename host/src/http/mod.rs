//! The HTTP endpoint: `/metrics`, `/healthz`, `/readyz` (`probes`, which need no token and
//! may have a listener of their own), and the admin API.
//!
//! `/admin/status` lists pipelines with their plugin build; `POST /admin/reload/{pipeline}`
//! hot-swaps a plugin; `POST /admin/pipelines/{pipeline}/pause|resume` pauses and resumes
//! one (`pipeline::pause`); `triage` lists and replays dead letters and parked outbox rows.
//!
//! Access: a request addressed (its `Host`) to a name this endpoint does not answer to is
//! refused on every route, so a page whose domain was rebound to this address reads and does
//! nothing (IP addresses, `localhost` and `[http] hosts` are answered). When an admin token is
//! configured, every `/admin` request requires `Authorization: Bearer <token>`, reads too and
//! on a loopback listener too (the config refuses a non-loopback address without a token). A
//! `POST` that a browser sends from another site (its `Origin` is not this host) is refused,
//! token or not. Nothing changes state on a `GET`: reading a RabbitMQ dead-letter queue takes
//! its messages and gives them back, so the dead-letter reads are `POST`s with a JSON body,
//! which no cross-site `<img>`, link or form can send. Every answer carries the security
//! headers.

mod console;
mod history;
mod probes;
pub mod sampler;
mod triage;

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::HttpConfig;
use crate::pipeline::reload::{self, Reloaded};
use crate::pipeline::{Pipeline, pause};
use crate::store::database::Databases;
use crate::telemetry::metrics::Metrics;

#[derive(Clone)]
struct AppState {
    pipelines: Arc<Vec<Arc<Pipeline>>>,
    metrics: Arc<Metrics>,
    /// Every database of the config, for the outbox and readiness.
    databases: Databases,
    admin_token: Option<Arc<str>>,
    /// `[http] hosts`: the names requests may be addressed to besides IPs and `localhost`.
    hosts: Arc<[String]>,
    history: Arc<history::History>,
}

/// A JSON answer with its status.
type Answer = (StatusCode, Json<serde_json::Value>);

/// An error answer: `{"error": …}` with `status`.
fn failed(status: StatusCode, error: impl std::fmt::Display) -> Answer {
    (status, Json(json!({ "error": error.to_string() })))
}

impl AppState {
    /// The pipeline named `name`, or a 404 answer.
    fn pipeline(&self, name: &str) -> Result<&Arc<Pipeline>, Answer> {
        self.pipelines
            .iter()
            .find(|pipeline| pipeline.name() == name)
            .ok_or_else(|| failed(StatusCode::NOT_FOUND, format!("no pipeline {name:?}")))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot listen for HTTP on {address}: {source}")]
pub struct HttpError {
    address: std::net::SocketAddr,
    source: std::io::Error,
}

/// Binds the listeners now (so a taken port fails start-up) and serves until `shutdown`.
pub async fn serve(
    config: &HttpConfig,
    pipelines: Vec<Arc<Pipeline>>,
    metrics: Arc<Metrics>,
    databases: Databases,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, HttpError> {
    let listener = probes::bind(config.listen).await?;
    let probes_listener = match config.metrics_listen {
        Some(address) => Some(probes::bind(address).await?),
        None => None,
    };
    let pipelines = Arc::new(pipelines);
    let sampled = sampler::spawn(
        Arc::clone(&pipelines),
        Arc::clone(&metrics),
        databases.clone(),
        shutdown.clone(),
    );
    let history = history::History::spawn(
        Arc::clone(&pipelines),
        Arc::clone(&metrics),
        sampled,
        shutdown.clone(),
    );
    let state = AppState {
        pipelines,
        metrics,
        databases,
        history,
        admin_token: config.admin_token.as_deref().map(Arc::from),
        hosts: Arc::from(config.hosts.as_slice()),
    };
    let probes =
        probes_listener.map(|listener| probes::serve(listener, state.clone(), shutdown.clone()));
    let app = routes(state, config.console);
    let address = listener.local_addr().unwrap_or(config.listen);
    if config.console {
        info!(%address, "HTTP endpoint listening: the console at http://{address}/, /metrics, /healthz, /readyz, /admin.");
    } else {
        info!(%address, "HTTP endpoint listening (/metrics, /healthz, /readyz, /admin).");
    }
    Ok(tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(error) = served {
            warn!(%error, "HTTP endpoint stopped.");
        }
        if let Some(probes) = probes {
            let _ = probes.await;
        }
    }))
}

/// Every route with its guards: the reads, the actions (and broker reads) behind
/// `guard_action`, the console unless turned off; `guard_host` and the security headers on all.
fn routes(state: AppState, console: bool) -> Router {
    let reads = Router::new()
        .route("/admin/status", get(status))
        .route(
            "/admin/history",
            get(|State(state): State<AppState>| async move { Json(state.history.json()) }),
        )
        .route("/admin/outbox", get(triage::outbox_rows))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard_read));
    let actions = Router::new()
        .route("/admin/dead-letters/{pipeline}/list", post(triage::list))
        .route("/admin/dead-letters/{pipeline}/show", post(triage::show))
        .route("/admin/reload/{pipeline}", post(reload_pipeline))
        .route("/admin/pipelines/{pipeline}/pause", post(pause_pipeline))
        .route("/admin/pipelines/{pipeline}/resume", post(resume_pipeline))
        .route(
            "/admin/dead-letters/{pipeline}/replay",
            post(triage::replay),
        )
        .route(
            "/admin/dead-letters/{pipeline}/discard",
            post(triage::discard),
        )
        .route(
            "/admin/dead-letters/{pipeline}/archive",
            post(triage::archive),
        )
        .route("/admin/outbox/retry", post(triage::outbox_retry))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard_action));
    let mut app = probes::routes().merge(reads).merge(actions);
    if console {
        app = app.merge(console::routes());
    }
    app.layer(middleware::from_fn(security_headers))
        .layer(middleware::from_fn_with_state(state.clone(), guard_host))
        .with_state(state)
}

/// Every route: only requests addressed to this endpoint's own names.
async fn guard_host(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if !addressed_here(&request, &state.hosts) {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            "this host does not answer to that name; add it to [http] hosts\n",
        )
            .into_response();
    }
    next.run(request).await
}

/// Whether `request`'s `Host` is an IP address, `localhost` or one of `hosts` (`"*"`: any
/// name). A request without one (HTTP/1.0) is not a browser's.
fn addressed_here(request: &Request, hosts: &[String]) -> bool {
    let Some(host) = request.headers().get(header::HOST) else {
        return true;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        // `[::1]:9464`
        Some(bracketed) => return bracketed.split(']').next().is_some_and(is_ip),
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name),
    };
    is_ip(name)
        || name.eq_ignore_ascii_case("localhost")
        || hosts
            .iter()
            .any(|allowed| allowed == "*" || allowed.eq_ignore_ascii_case(name))
}

fn is_ip(name: &str) -> bool {
    name.parse::<std::net::IpAddr>().is_ok()
}

/// Every answer: never sniffed, framed, cached (the admin API's) or sent on as a referrer.
async fn security_headers(request: Request, next: Next) -> Response {
    let admin = request.uri().path().starts_with("/admin");
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    let mut set = |name, value: &'static str| {
        headers
            .entry(name)
            .or_insert(header::HeaderValue::from_static(value));
    };
    set(header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(header::X_FRAME_OPTIONS, "DENY");
    set(header::REFERRER_POLICY, "no-referrer");
    set(
        header::CONTENT_SECURITY_POLICY,
        "default-src 'none'; frame-ancestors 'none'",
    );
    if admin {
        set(header::CACHE_CONTROL, "no-store");
    }
    response
}

/// A read: the token when one is set.
async fn guard_read(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if !token_presented(&state, &request) {
        return token_required();
    }
    next.run(request).await
}

/// A `POST` (an action, or a read that touches the broker): from this host's own pages or a
/// non-browser client, with the token when one is set.
async fn guard_action(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if !same_origin(&request) {
        return (
            StatusCode::FORBIDDEN,
            "cross-site request refused: the Origin is not this host\n",
        )
            .into_response();
    }
    if !token_presented(&state, &request) {
        return token_required();
    }
    next.run(request).await
}

fn token_required() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "admin token required\n",
    )
        .into_response()
}

/// Whether `request` carries the admin token, or none is configured.
fn token_presented(state: &AppState, request: &Request) -> bool {
    let Some(token) = &state.admin_token else {
        return true;
    };
    request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .is_some_and(|presented| same_secret(presented, token))
}

/// Whether a request is not a browser's cross-site one: without `Origin` (curl, scripts) or
/// with this host's own. A page on another site cannot forge `Origin`.
fn same_origin(request: &Request) -> bool {
    let Some(origin) = request.headers().get(header::ORIGIN) else {
        return true;
    };
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|value| value.to_str().ok());
    match (origin.to_str(), host) {
        (Ok(origin), Some(host)) => origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|origin_host| origin_host.eq_ignore_ascii_case(host)),
        _ => false,
    }
}

/// Compares a presented token with the configured one in time that does not depend on how
/// much of a guess was right (`subtle`; a length difference shows, the content does not).
fn same_secret(presented: &str, expected: &str) -> bool {
    use subtle::ConstantTimeEq;
    presented.as_bytes().ct_eq(expected.as_bytes()).into()
}

async fn status(State(state): State<AppState>) -> Json<serde_json::Value> {
    let pipelines: Vec<serde_json::Value> = state
        .pipelines
        .iter()
        .map(|pipeline| {
            let plugin = pipeline.plugin();
            let reload_status = pipeline.reload_status();
            json!({
                "name": pipeline.name(),
                "source": pipeline.config().source_kind(),
                "queue": pipeline.config().queue(),
                "dead_letter_queue": pipeline.config().dead_letter(),
                "consuming": pipeline.is_consuming(),
                "source_problem": pipeline.source_problem(),
                "workers": pipeline.config().workers.get(),
                "prefetch": pipeline.config().prefetch.get(),
                "paused": pipeline.paused().map(|paused| json!({
                    "statement": paused.statement,
                    "sqlstate": paused.sqlstate,
                    "reason": paused.reason,
                })),
                "operator_pause": pipeline.operator_pause().map(|pause| json!({
                    "reason": pause.reason,
                    "since": unix_seconds(pause.since),
                    "persistent": pause.persistent,
                })),
                "plugin": {
                    "path": plugin.path.display().to_string(),
                    "digest": plugin.digest,
                    "contract": crate::sandbox::contract::describe(&plugin.contract),
                    "contract_deprecated": crate::sandbox::contract::is_deprecated(&plugin.contract),
                    "loaded_at": unix_seconds(plugin.loaded_at),
                },
                "last_reload_at": reload_status.last_attempt_at.map(unix_seconds),
                "last_reload_error": reload_status.last_error,
            })
        })
        .collect();
    Json(json!({ "pipelines": pipelines }))
}

async fn reload_pipeline(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Answer, Answer> {
    let pipeline = state.pipeline(&name)?;
    Ok(match reload::reload(pipeline, "admin").await {
        Ok(Reloaded::Swapped { from, to }) => (
            StatusCode::OK,
            Json(json!({ "result": "swapped", "from": from, "to": to })),
        ),
        Ok(Reloaded::Unchanged { digest }) => (
            StatusCode::OK,
            Json(json!({ "result": "unchanged", "digest": digest })),
        ),
        Err(error) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({ "result": "refused", "error": error.to_string() })),
        ),
    })
}

/// `POST /admin/pipelines/{pipeline}/pause` with `{"reason": …, "persist": …}` (both
/// optional).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseRequest {
    reason: Option<String>,
    /// Recorded for every host of the pipeline's consumer, across restarts.
    #[serde(default)]
    persist: bool,
}

async fn pause_pipeline(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Json(request): Json<PauseRequest>,
) -> Result<Answer, Answer> {
    let pipeline = state.pipeline(&name)?;
    let database = state.databases.named(pipeline.config().database.as_deref());
    let newly = pause::pause(
        pipeline,
        database,
        request.reason.as_deref(),
        request.persist,
    )
    .await
    .map_err(|error| {
        failed(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the pause could not be recorded in the database, nothing paused: {error}"),
        )
    })?;
    let pause = pipeline.operator_pause();
    Ok((
        StatusCode::OK,
        Json(json!({
            "pipeline": name,
            "paused": true,
            "was_running": newly,
            "reason": pause.as_ref().map(|pause| pause.reason.clone()),
            "persistent": pause.is_some_and(|pause| pause.persistent),
        })),
    ))
}

/// `POST /admin/pipelines/{pipeline}/resume`: ends the pause here and, if one is recorded,
/// on every host.
async fn resume_pipeline(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Answer, Answer> {
    let pipeline = state.pipeline(&name)?;
    let database = state.databases.named(pipeline.config().database.as_deref());
    let ended = pause::resume(pipeline, database).await.map_err(|error| {
        failed(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the recorded pause could not be cleared, still paused: {error}"),
        )
    })?;
    Ok((
        StatusCode::OK,
        Json(json!({ "pipeline": name, "paused": false, "was_paused": ended.is_some() })),
    ))
}

fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::{addressed_here, same_origin, same_secret};

    fn request(headers: &[(&str, &str)]) -> axum::extract::Request {
        let mut builder = axum::http::Request::builder()
            .method("POST")
            .uri("/admin/x");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(axum::body::Body::empty()).expect("request")
    }

    #[test]
    fn actions_from_another_site_are_told_apart() {
        let host = ("Host", "127.0.0.1:9464");
        assert!(same_origin(&request(&[host])), "curl sends no Origin");
        assert!(same_origin(&request(&[
            host,
            ("Origin", "http://127.0.0.1:9464")
        ])));
        assert!(same_origin(&request(&[
            host,
            ("Origin", "https://127.0.0.1:9464")
        ])));
        assert!(!same_origin(&request(&[
            host,
            ("Origin", "http://evil.example")
        ])));
        assert!(!same_origin(&request(&[
            host,
            ("Origin", "http://127.0.0.1:9465")
        ])));
        assert!(!same_origin(&request(&[host, ("Origin", "null")])));
        assert!(!same_origin(&request(&[(
            "Origin",
            "http://127.0.0.1:9464"
        )])));
    }

    #[test]
    fn requests_to_other_names_are_told_apart() {
        let hosts = ["idem.internal".to_string()];
        let to = |host: &str| addressed_here(&request(&[("Host", host)]), &hosts);
        for here in [
            "127.0.0.1:9464",
            "10.1.2.3",
            "[::1]:9464",
            "localhost:9464",
            "LOCALHOST",
            "idem.internal:9464",
        ] {
            assert!(to(here), "{here}");
        }
        for elsewhere in [
            "evil.example:9464",
            "localhost.evil.example",
            "[evil]:1",
            "idem",
        ] {
            assert!(!to(elsewhere), "{elsewhere}");
        }
        assert!(addressed_here(&request(&[]), &hosts), "HTTP/1.0, no Host");
        assert!(addressed_here(
            &request(&[("Host", "anything.example")]),
            &["*".to_string()]
        ));
    }

    #[test]
    fn token_comparison() {
        assert!(same_secret("s3cret", "s3cret"));
        assert!(!same_secret("s3cre", "s3cret"));
        assert!(!same_secret("s3cretX", "s3cret"));
        assert!(!same_secret("S3cret", "s3cret"));
        assert!(!same_secret("", "s3cret"));
    }
}
