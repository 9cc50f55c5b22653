//! idem turns at-least-once message delivery into exactly-once Postgres effects.
//!
//! A pipeline consumes one RabbitMQ queue. Each message goes to a sandboxed WebAssembly
//! plugin that returns an idempotency key and a list of effects (calls of named SQL
//! statements). The host inserts the claim and runs the effects in one transaction,
//! commits, and only then acks. A redelivery finds the claim and changes nothing.
//!
//! # Layout, in reading order
//! - [`config`]: `pipelines.toml`, parsed and validated once.
//! - [`pipeline`]: per pipeline, the consume loop, bounded workers and settling.
//! - [`process`]: one message start to finish; the only place that picks a disposition.
//! - [`plugin`]: wasmtime components, a fresh sandbox per message, deadline and memory limits.
//! - [`statement`]: named statements, prepared at start-up, effects type-checked against them.
//! - [`ledger`]: the transaction: claim (ledger, natural or none), effects, outbox rows, commit,
//!   sent in pipelined flights.
//! - [`session`]: the pooled tokio-postgres connections the transactions run on.
//! - [`fault`]: whose fault a database error is: reject the message, retry, or pause.
//! - [`outbox`]: outbox rows, and the relay that delivers them after commit.
//! - [`amqp`]: lapin: connect, declare, consume, dead-letter, ack.
//! - [`reload`]: hot swap of plugins (file watch, SIGHUP, admin call).
//! - [`retention`], [`partition`]: batched deletion of old claims, or daily partitions dropped whole.
//! - [`http`], [`metrics`]: `/metrics`, `/healthz`, `/readyz`, `/admin/…`.
//! - [`database`]: opens the sessions and the bookkeeping pool (sqlx); migrations, schema check.
//! - [`cases`]: plugin test cases (`idem test`) and the JSON form of an outcome (`idem try`).
//! - [`effect`], [`message`]: the data passed between them.
//! - [`backoff`], [`failpoint`]: retry timing, and crash points for tests.

pub mod amqp;
pub mod backoff;
pub mod cases;
pub mod config;
pub mod consumer;
pub mod database;
pub mod effect;
pub mod failpoint;
pub mod fault;
pub mod http;
pub mod ledger;
pub mod message;
pub mod metrics;
pub mod outbox;
pub mod partition;
pub mod pipeline;
pub mod plugin;
pub mod process;
pub mod reload;
pub mod retention;
pub mod session;
pub mod statement;
pub mod tls;

use std::future::Future;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::amqp::AmqpError;
use crate::config::Config;
use crate::database::DatabaseError;
use crate::http::HttpError;
use crate::metrics::Metrics;
use crate::outbox::RelayWaker;
use crate::pipeline::{Pipeline, PipelineError};
use crate::plugin::{PluginError, PluginRuntime};

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
    Amqp(#[from] AmqpError),
    #[error(transparent)]
    Destination(#[from] outbox::DestinationError),
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
    let serving = async {
        let Some(database) = database::connect(&config.database, &token).await? else {
            return Ok(());
        };
        let pool = database.pool.clone();
        database::check_schema(&pool, &config.database, config.outbox.is_some()).await?;
        database::record_consumers(&pool, &config.database, &config.pipelines).await?;
        let runtime = PluginRuntime::for_config(&config)?;
        let relay = RelayWaker::default();
        let mut pipelines = Vec::with_capacity(config.pipelines.len());
        for pipeline_config in &config.pipelines {
            let mut pipeline = Pipeline::start(
                pipeline_config.clone(),
                runtime.clone(),
                &database,
                Arc::clone(&metrics),
            )
            .await?;
            pipeline.relay = relay.clone();
            pipelines.push(Arc::new(pipeline));
        }
        if let Some(outbox_config) = config.outbox.as_ref().filter(|outbox| outbox.relay) {
            outbox::spawn_relay(
                outbox_config.clone(),
                outbox::http_clients(outbox_config)?,
                pool.clone(),
                config.amqp.clone(),
                Arc::clone(&metrics),
                relay,
                token.clone(),
            );
        }
        let http = match &config.http {
            Some(http_config) => Some(
                http::serve(
                    http_config,
                    pipelines.clone(),
                    Arc::clone(&metrics),
                    pool.clone(),
                    token.clone(),
                )
                .await?,
            ),
            None => None,
        };
        reload::spawn_watcher(pipelines.clone(), token.clone());
        reload::spawn_sighup_listener(pipelines.clone(), token.clone());
        retention::spawn_cleaner(
            &pipelines,
            pool.clone(),
            Arc::clone(&metrics),
            token.clone(),
        );
        let mut consumers = JoinSet::new();
        for pipeline in &pipelines {
            consumers.spawn(consumer::consume(
                Arc::clone(pipeline),
                config.amqp.clone(),
                token.clone(),
            ));
        }
        info!(pipelines = pipelines.len(), "idem is running.");
        let mut refused = None;
        while let Some(ended) = consumers.join_next().await {
            if let Ok(Err(error)) = ended {
                // A refusal no retry can fix: stop every pipeline and say which setting.
                token.cancel();
                refused.get_or_insert(error);
            }
        }
        if let Some(http) = http {
            let _ = http.await;
        }
        database.sessions.close_idle();
        pool.close().await;
        match refused {
            Some(error) => Err(error.into()),
            None => Ok(()),
        }
    };
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
