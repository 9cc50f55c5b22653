//! idem turns at-least-once message delivery into exactly-once Postgres effects.
//!
//! A pipeline consumes one RabbitMQ queue or JetStream stream. Each message goes to a sandboxed WebAssembly
//! plugin that returns an idempotency key and a list of effects (calls of named SQL
//! statements). The host inserts the claim and runs the effects in one transaction,
//! commits, and only then acks. A redelivery finds the claim and changes nothing.
//!
//! # Layout: the way a message travels
//! - [`config`]: `pipelines.toml`, parsed and validated once.
//! - [`source`]: where messages come from and how each is settled: the [`source::Source`]
//!   interface and its implementations for RabbitMQ ([`source::rabbitmq`]) and NATS JetStream
//!   ([`source::jetstream`]).
//! - [`pipeline`]: a pipeline at run time: its parts put together (plugin, statements,
//!   sessions, both pauses), the consume loop over its source ([`pipeline::consume`]:
//!   batches, bounded workers, settling after the transaction), one message or batch start
//!   to finish ([`pipeline::process`], the only place that picks a disposition), the
//!   adaptive batch size, hot swap of its plugin ([`pipeline::reload`]: file watch, SIGHUP,
//!   admin call), and an operator's pause and resume, on one host or recorded for all
//!   ([`pipeline::pause`]).
//! - [`sandbox`]: the plugin runtime: wasmtime components, a sandbox per message, deadline and
//!   memory limits, the compile cache.
//! - [`store`]: PostgreSQL: the transaction ([`store::ledger`]), named statements, sessions,
//!   whose fault an error is, the outbox table, retention and partitions, connecting.
//! - [`relay`]: the outbox relay, delivering committed outbox rows to HTTP endpoints and AMQP
//!   exchanges.
//! - [`http`]: the HTTP listener (`/metrics`, `/healthz`, `/readyz`, `/admin/…`, the console),
//!   with the gauges sampled from the sources and databases on an interval
//!   ([`http::sampler`]).
//! - [`telemetry`]: the counters and histograms every layer records into
//!   ([`telemetry::metrics`]), a span per message parented by the producer's trace context
//!   and handed on to the outbox ([`telemetry::traces`]), and their OTLP export.
//! - [`triage`]: dead letters archived and discarded with a replay's selection (`idem dlq`,
//!   the console).
//! - [`cases`]: plugin test cases (`idem test`) and the JSON form of an outcome (`idem try`).
//! - [`effect`], [`message`]: the data passed between them.
//! - [`backoff`], [`failpoint`], [`tls`]: retry timing, crash points for tests, TLS verdicts.

pub mod backoff;
pub mod cases;
pub mod config;
pub mod effect;
pub mod failpoint;
pub mod http;
pub mod message;
pub mod pipeline;
pub mod relay;
pub mod sandbox;
pub mod source;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod triage;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::http::HttpError;
use crate::pipeline::{Pipeline, PipelineError};
use crate::relay::RelayWaker;
use crate::sandbox::{PluginError, PluginRuntime};
use crate::source::SourceError;
use crate::store::database::{self, DatabaseError, Databases};
use crate::store::retention;
use crate::telemetry::metrics::Metrics;

/// Why the host could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Database(#[from] DatabaseError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Destination(#[from] relay::DestinationError),
}

/// Runs every pipeline of `config` until `shutdown` completes, then drains: stops consuming,
/// lets started messages commit and ack, and closes connections.
///
/// Waits for PostgreSQL and RabbitMQ with backoff if they are down. Returns an error only
/// for problems a restart cannot fix: a missing claim table, a plugin or statement that is
/// invalid.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    run_with_metrics(config, Arc::new(Metrics::new()), shutdown).await
}

/// [`run`], recording into `metrics` (tests read them directly).
pub async fn run_with_metrics(
    config: Config,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    let token = CancellationToken::new();
    let trigger = token.clone();
    let serving = serve(&config, metrics, &token);
    tokio::pin!(serving);
    tokio::select! {
        result = &mut serving => {
            // Startup failed, or every consumer ended.
            trigger.cancel();
            result
        }
        () = shutdown => {
            info!("Shutting down: finishing messages in flight.");
            trigger.cancel();
            let result = serving.await;
            info!("Stopped.");
            result
        }
    }
}

/// Connects, starts every pipeline and what serves them, and consumes until `token` is
/// cancelled or a source is refused.
async fn serve(
    config: &Config,
    metrics: Arc<Metrics>,
    token: &CancellationToken,
) -> Result<(), StartError> {
    let Some(databases) = Databases::connect(config, token).await? else {
        return Ok(());
    };
    // `Databases` opened them in the config's order.
    for ((name, database_config), (_, database)) in config.all_databases().zip(databases.iter()) {
        database::check_schema(&database.pool, database_config, config.outbox.is_some()).await?;
        retention::record_consumers(&database.pool, database_config, &config.pipelines_in(name))
            .await?;
    }
    let runtime = PluginRuntime::for_config(config)?;
    // One relay per database, woken by the pipelines that write there.
    let wakers: Vec<RelayWaker> = databases.iter().map(|_| RelayWaker::default()).collect();
    let mut pipelines = Vec::with_capacity(config.pipelines.len());
    for pipeline_config in &config.pipelines {
        let name = pipeline_config.database.as_deref();
        let position = databases.iter().position(|(opened, _)| opened == name);
        let pipeline = Pipeline::start(
            pipeline_config.clone(),
            runtime.clone(),
            databases.named(name),
            Arc::clone(&metrics),
            wakers[position.expect("opened from the config")].clone(),
        )
        .await?;
        pipelines.push(Arc::new(pipeline));
    }
    if let Some(outbox_config) = config.outbox.as_ref().filter(|outbox| outbox.relay) {
        let http_clients = relay::http_clients(outbox_config)?;
        for ((_, database), waker) in databases.iter().zip(&wakers) {
            relay::spawn_relay(
                outbox_config.clone(),
                http_clients.clone(),
                database.clone(),
                Arc::clone(&metrics),
                waker.clone(),
                token.clone(),
            );
        }
    }
    let http = match &config.http {
        Some(http_config) => Some(
            http::serve(
                http_config,
                pipelines.clone(),
                Arc::clone(&metrics),
                databases.clone(),
                token.clone(),
            )
            .await?,
        ),
        None => None,
    };
    // Before anything is consumed: a pipeline paused for every host stays paused here.
    pipeline::pause::follow_recorded_pauses(pipelines.clone(), databases.clone(), token.clone())
        .await;
    pipeline::reload::spawn_watcher(pipelines.clone(), token.clone());
    pipeline::reload::spawn_sighup_listener(pipelines.clone(), token.clone());
    for (name, database) in databases.iter() {
        retention::spawn_cleaner(
            &config.pipelines_in(name),
            database.clone(),
            Arc::clone(&metrics),
            token.clone(),
        );
    }
    let refused = consume(&pipelines, token).await;
    close(http, &databases).await;
    match refused {
        Some(error) => Err(error.into()),
        None => Ok(()),
    }
}

/// How long closing the database pools may take at the end: a connection still busy (a
/// query a pooler queues, a bookkeeping task between its tries) must not hold the exit;
/// every transaction has committed or rolled back by then, so nothing depends on it.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// After every pipeline stopped: waits for the HTTP endpoint, then closes every database
/// pool, giving up after [`CLOSE_WITHIN`] (the process exit closes what is left).
async fn close(http: Option<tokio::task::JoinHandle<()>>, databases: &Databases) {
    info!("Every pipeline stopped consuming; closing connections.");
    if let Some(http) = http {
        let _ = http.await;
    }
    if tokio::time::timeout(CLOSE_WITHIN, databases.close())
        .await
        .is_err()
    {
        warn!(
            within = ?CLOSE_WITHIN,
            "Database connections still busy; leaving them to close with the process."
        );
    }
}

/// Consumes every pipeline until each consumer ended; the first refusal (no retry can fix
/// it) stops them all and is returned, to name its setting.
async fn consume(pipelines: &[Arc<Pipeline>], token: &CancellationToken) -> Option<SourceError> {
    let mut consumers = JoinSet::new();
    for pipeline in pipelines {
        let consuming = pipeline::consume::consume_pipeline(Arc::clone(pipeline), token.clone());
        let name = pipeline.name().to_string();
        consumers.spawn(async move { (name, consuming.await) });
    }
    info!(pipelines = pipelines.len(), "idem is running.");
    let mut refused = None;
    while let Some(ended) = consumers.join_next().await {
        let Ok((name, ended)) = ended else {
            continue;
        };
        info!(pipeline = %name, "Pipeline stopped.");
        if let Err(error) = ended {
            token.cancel();
            refused.get_or_insert(error);
        }
    }
    refused
}
