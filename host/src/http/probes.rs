//! What a scraper and an orchestrator read: `/metrics`, `/healthz` and `/readyz`, never
//! behind the admin token. On the main listener with the rest; with `[http] metrics_listen`,
//! also on a listener of their own that serves nothing else, so it can face the network (a
//! Prometheus scrape, a kubelet probe) while the admin API stays on loopback.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{AppState, HttpError, security_headers};

/// The three routes.
pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_text))
}

/// Binds `address` now (so a taken port fails start-up) for the three routes alone.
pub(super) async fn bind(address: SocketAddr) -> Result<TcpListener, HttpError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| HttpError { address, source })
}

/// Serves the three routes alone on `listener` until `shutdown`.
pub(super) fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let app = routes()
        .layer(middleware::from_fn(security_headers))
        .with_state(state);
    if let Ok(address) = listener.local_addr() {
        info!(%address, "Metrics and health listening (/metrics, /healthz, /readyz).");
    }
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(error) = served {
            warn!(%error, "Metrics listener stopped.");
        }
    })
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

/// Ready when every database answers and every pipeline is subscribed to its queue, but for
/// those an operator paused.
async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let mut problems = Vec::new();
    for (name, database) in state.databases.iter() {
        let answer = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::raw_sql("SELECT 1").execute(&database.pool),
        )
        .await;
        let label = match name {
            Some(name) => format!("database {name:?}"),
            None => "database".to_string(),
        };
        match answer {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => problems.push(format!("{label}: {error}")),
            Err(_) => problems.push(format!("{label}: no answer within 2 s")),
        }
    }
    for pipeline in state.pipelines.iter() {
        if let Some(paused) = pipeline.paused() {
            problems.push(format!("pipeline {:?}: {paused}", pipeline.name()));
        }
        // An operator's pause is intended: the host is ready (a rolling deploy goes on while a
        // pipeline is paused); `/admin/status` and `idem_pipeline_operator_paused` show it.
        if pipeline.operator_pause().is_some() {
            continue;
        }
        if !pipeline.is_consuming() {
            problems.push(format!(
                "pipeline {:?}: not consuming {:?}",
                pipeline.name(),
                pipeline.config().queue()
            ));
        } else if let Some(problem) = pipeline.source_problem() {
            problems.push(format!("pipeline {:?}: {problem}", pipeline.name()));
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
