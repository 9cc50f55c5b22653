//! The HTTP endpoint: `/metrics`, `/healthz`, `/readyz`, and the admin API.
//!
//! `/admin/status` lists pipelines with their plugin build; `POST /admin/reload/{pipeline}`
//! hot-swaps a plugin. When an admin token is configured, `/admin/…` requires
//! `Authorization: Bearer <token>`; the config refuses a non-loopback address without one.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::HttpConfig;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use crate::reload::{self, Reloaded};

#[derive(Clone)]
struct AppState {
    pipelines: Arc<Vec<Arc<Pipeline>>>,
    metrics: Arc<Metrics>,
    pool: PgPool,
    admin_token: Option<Arc<str>>,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot listen for HTTP on {address}: {source}")]
pub struct HttpError {
    address: std::net::SocketAddr,
    source: std::io::Error,
}

/// Binds the listener now (so a taken port fails start-up) and serves until `shutdown`.
pub async fn serve(
    config: &HttpConfig,
    pipelines: Vec<Arc<Pipeline>>,
    metrics: Arc<Metrics>,
    pool: PgPool,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, HttpError> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| HttpError {
            address: config.listen,
            source,
        })?;
    let state = AppState {
        pipelines: Arc::new(pipelines),
        metrics,
        pool,
        admin_token: config.admin_token.as_deref().map(Arc::from),
    };
    let admin = Router::new()
        .route("/admin/status", get(status))
        .route("/admin/reload/{pipeline}", post(reload_pipeline))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_text))
        .merge(admin)
        .with_state(state);
    let address = listener.local_addr().unwrap_or(config.listen);
    info!(%address, "HTTP endpoint listening (/metrics, /healthz, /readyz, /admin).");
    Ok(tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(error) = served {
            warn!(%error, "HTTP endpoint stopped.");
        }
    }))
}

async fn require_token(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(token) = &state.admin_token {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        if !presented.is_some_and(|presented| same_secret(presented, token)) {
            return (StatusCode::UNAUTHORIZED, "admin token required\n").into_response();
        }
    }
    next.run(request).await
}

/// Compares a presented token with the configured one in time that depends only on their
/// lengths, so response timing does not reveal how much of a guess was right.
fn same_secret(presented: &str, expected: &str) -> bool {
    let (presented, expected) = (presented.as_bytes(), expected.as_bytes());
    let mut difference = u8::from(presented.len() != expected.len());
    for (index, expected_byte) in expected.iter().enumerate() {
        difference |= expected_byte ^ presented.get(index).copied().unwrap_or(!expected_byte);
    }
    difference == 0
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

/// Ready when the database answers and every pipeline is subscribed to its queue.
async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let mut problems = Vec::new();
    let database = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query("SELECT 1").execute(&state.pool),
    )
    .await;
    match database {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => problems.push(format!("database: {error}")),
        Err(_) => problems.push("database: no answer within 2 s".to_string()),
    }
    for pipeline in state.pipelines.iter() {
        if let Some(paused) = pipeline.paused() {
            problems.push(format!("pipeline {:?}: {paused}", pipeline.name()));
        }
        if !pipeline.consuming.load(Ordering::Relaxed) {
            problems.push(format!(
                "pipeline {:?}: not consuming {:?}",
                pipeline.name(),
                pipeline.config.queue()
            ));
        }
    }
    if problems.is_empty() {
        (StatusCode::OK, Json(json!({ "ready": true })))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "ready": false, "problems": problems })),
        )
    }
}

async fn status(State(state): State<AppState>) -> Json<serde_json::Value> {
    let pipelines: Vec<serde_json::Value> = state
        .pipelines
        .iter()
        .map(|pipeline| {
            let plugin = pipeline.plugin.load();
            let reload_status = pipeline
                .reload_status
                .lock()
                .map(|status| status.clone())
                .unwrap_or_default();
            json!({
                "name": pipeline.name(),
                "source": pipeline.config.source_kind(),
                "queue": pipeline.config.queue(),
                "dead_letter_queue": pipeline.config.dead_letter(),
                "consuming": pipeline.consuming.load(Ordering::Relaxed),
                "paused": pipeline.paused().map(|paused| json!({
                    "statement": paused.statement,
                    "sqlstate": paused.sqlstate,
                    "reason": paused.reason,
                })),
                "plugin": {
                    "path": plugin.path.display().to_string(),
                    "digest": plugin.digest,
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
) -> (StatusCode, Json<serde_json::Value>) {
    let Some(pipeline) = state
        .pipelines
        .iter()
        .find(|pipeline| pipeline.name() == name)
    else {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": format!("no pipeline {name:?}") })),
        );
    };
    match reload::reload(pipeline, "admin").await {
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
    }
}

fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::same_secret;

    #[test]
    fn token_comparison() {
        assert!(same_secret("s3cret", "s3cret"));
        assert!(!same_secret("s3cre", "s3cret"));
        assert!(!same_secret("s3cretX", "s3cret"));
        assert!(!same_secret("S3cret", "s3cret"));
        assert!(!same_secret("", "s3cret"));
    }
}
