//! One pipeline at run time: its plugin, its statements, and the consume loop that feeds
//! deliveries to bounded workers and settles each one after its transaction.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use futures::StreamExt;
use lapin::Channel;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::amqp::{self, AmqpError, Receipt, Session};
use crate::backoff::Backoff;
use crate::config::{AmqpConfig, ClaimMode, Isolation, PipelineConfig};
use crate::effect::Outcome;
use crate::failpoint::Failpoint;
use crate::ledger::Plan;
use crate::message::InboundMessage;
use crate::metrics::Metrics;
use crate::outbox::RelayWaker;
use crate::plugin::{LoadedPlugin, PluginError, PluginRuntime};
use crate::process::{self, Disposition};
use crate::statement::{StatementCatalog, StatementErrors};

/// Everything a worker needs to handle a message of this pipeline.
pub struct Pipeline {
    pub config: PipelineConfig,
    pub runtime: PluginRuntime,
    /// The plugin serving new messages; a message in flight keeps the version it started with.
    pub plugin: ArcSwap<LoadedPlugin>,
    pub statements: StatementCatalog,
    pub pool: PgPool,
    pub metrics: Arc<Metrics>,
    /// The last reload attempt, for the admin status.
    pub reload_status: Mutex<ReloadStatus>,
    /// True while a consumer is subscribed to the queue.
    pub consuming: AtomicBool,
    /// `processed_messages` is partitioned by day: claims use the partition-safe form.
    pub partitioned_claims: bool,
    /// Serialises reloads of this pipeline.
    pub(crate) reload_lock: tokio::sync::Mutex<()>,
    /// Wakes this host's outbox relay after a commit that wrote outbox rows.
    pub relay: RelayWaker,
    /// Held while a batch of several messages is applied: a multi-message transaction holds
    /// many row locks, and two of them in parallel deadlock on shared rows (one customer's
    /// balance). Plugin calls and single-message transactions still run in parallel.
    pub(crate) batch_applier: tokio::sync::Mutex<()>,
    /// `Some` while a configuration fault pauses the pipeline: no new deliveries are taken
    /// until a retry of the failing transaction succeeds.
    paused: tokio::sync::watch::Sender<Option<Paused>>,
}

/// Why a pipeline is paused: the statement that failed for a configuration reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paused {
    pub statement: String,
    pub sqlstate: String,
    /// The database's words.
    pub reason: String,
}

impl std::fmt::Display for Paused {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "paused: statement {:?} failed with SQLSTATE {}: {}",
            self.statement, self.sqlstate, self.reason
        )
    }
}

/// What the last reload attempt of a pipeline's plugin did.
#[derive(Debug, Clone, Default)]
pub struct ReloadStatus {
    pub last_attempt_at: Option<SystemTime>,
    /// Why the last attempt was refused; `None` after a success.
    pub last_error: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("pipeline {pipeline:?}: {source}")]
    Plugin {
        pipeline: String,
        source: PluginError,
    },
    #[error(transparent)]
    Statement(#[from] StatementErrors),
    #[error("pipeline {pipeline:?}: cannot inspect processed_messages: {source}")]
    Schema {
        pipeline: String,
        source: sqlx::Error,
    },
    #[error("pipeline {pipeline:?}: transaction.role {role:?} cannot be used: {reason}")]
    Role {
        pipeline: String,
        role: String,
        reason: String,
    },
    #[error(
        "pipeline {pipeline:?}: processed_messages is partitioned, and partition-safe claims need transaction.isolation = \"read-committed\", not {isolation:?}"
    )]
    PartitionIsolation {
        pipeline: String,
        isolation: crate::config::Isolation,
    },
    #[error("pipeline {pipeline:?}: plugin {digest} failed its self-test {path:?}: {reason}")]
    SelfTest {
        pipeline: String,
        digest: String,
        path: std::path::PathBuf,
        reason: String,
    },
}

impl Pipeline {
    /// Compiles the plugin (off the async threads) and prepares every statement.
    pub async fn start(
        config: PipelineConfig,
        runtime: PluginRuntime,
        pool: PgPool,
        metrics: Arc<Metrics>,
    ) -> Result<Pipeline, PipelineError> {
        let plugin = load_plugin(&runtime, &config).await?;
        let statements = StatementCatalog::prepare(&pool, &config).await?;
        self_test(&runtime, &config, &statements, &plugin).await?;
        let partitioned_claims =
            crate::partition::is_partitioned(&pool)
                .await
                .map_err(|source| PipelineError::Schema {
                    pipeline: config.name.clone(),
                    source,
                })?;
        if partitioned_claims
            && config.claim == ClaimMode::Ledger
            && config.transaction.isolation != Isolation::ReadCommitted
        {
            return Err(PipelineError::PartitionIsolation {
                pipeline: config.name.clone(),
                isolation: config.transaction.isolation,
            });
        }
        if let Some(role) = &config.transaction.role {
            check_role(&pool, &config.name, role).await?;
        }
        info!(
            pipeline = %config.name,
            plugin = %plugin.path.display(),
            digest = %plugin.digest,
            compiled = plugin.compiled.as_str(),
            statements = config.statements.len(),
            "Pipeline ready."
        );
        Ok(Pipeline {
            config,
            runtime,
            plugin: ArcSwap::from_pointee(plugin),
            statements,
            pool,
            metrics,
            reload_status: Mutex::new(ReloadStatus::default()),
            consuming: AtomicBool::new(false),
            partitioned_claims,
            reload_lock: tokio::sync::Mutex::new(()),
            relay: RelayWaker::default(),
            batch_applier: tokio::sync::Mutex::new(()),
            paused: tokio::sync::watch::Sender::new(None),
        })
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Stops taking deliveries because of a configuration fault; says so loudly, once per
    /// distinct reason.
    pub fn pause(&self, paused: Paused) {
        let mut newly = false;
        let changed = self.paused.send_if_modified(|current| {
            newly = current.is_none();
            if current.as_ref() == Some(&paused) {
                return false;
            }
            *current = Some(paused.clone());
            true
        });
        if newly {
            self.metrics.pipeline_paused(self.name(), true);
        }
        if changed {
            error!(
                pipeline = %self.name(),
                statement = %paused.statement,
                sqlstate = %paused.sqlstate,
                reason = %paused.reason,
                "Pipeline paused by a configuration fault: no message is applied or dead-lettered until the statement works again; retrying every few seconds."
            );
        } else {
            debug!(pipeline = %self.name(), "Still paused.");
        }
    }

    /// Takes deliveries again after a pause.
    pub fn resume(&self) {
        let was_paused = self
            .paused
            .send_if_modified(|current| current.take().is_some());
        if was_paused {
            self.metrics.pipeline_paused(self.name(), false);
            info!(pipeline = %self.name(), "Pipeline resumed: the statement works again.");
        }
    }

    /// Why the pipeline is paused, if it is.
    pub fn paused(&self) -> Option<Paused> {
        self.paused.borrow().clone()
    }

    /// Returns once the pipeline is not paused.
    async fn unpaused(&self) {
        let mut receiver = self.paused.subscribe();
        let _ = receiver.wait_for(Option::is_none).await;
    }
}

/// Runs `plugin` on the pipeline's self-test message, if it has one: the plugin must decide or
/// skip, and every effect must fit its statement.
pub async fn self_test(
    runtime: &PluginRuntime,
    config: &PipelineConfig,
    statements: &StatementCatalog,
    plugin: &LoadedPlugin,
) -> Result<(), PipelineError> {
    let Some(path) = &config.self_test else {
        return Ok(());
    };
    let refuse = |reason: String| PipelineError::SelfTest {
        pipeline: config.name.clone(),
        digest: plugin.digest.clone(),
        path: path.clone(),
        reason,
    };
    let body = tokio::fs::read(path)
        .await
        .map_err(|error| refuse(format!("cannot read the message: {error}")))?;
    let message = InboundMessage {
        pipeline: config.name.clone(),
        body,
        routing_key: config.queue.clone(),
        ..InboundMessage::default()
    };
    match runtime.invoke(plugin, &config.limits, &message).await {
        Ok(Outcome::Skip { .. }) => Ok(()),
        Ok(Outcome::Decision(decision)) => {
            Plan::build(config, statements, &decision, &plugin.digest, false)
                .map_err(|error| refuse(error.to_string()))?;
            Ok(())
        }
        Err(error) => Err(refuse(error.to_string())),
    }
}

/// The host's login role must be able to `SET ROLE` to `role`.
async fn check_role(pool: &PgPool, pipeline: &str, role: &str) -> Result<(), PipelineError> {
    let refuse = |reason: String| PipelineError::Role {
        pipeline: pipeline.to_string(),
        role: role.to_string(),
        reason,
    };
    let member: Option<bool> = sqlx::query_scalar(
        "SELECT pg_has_role(current_user, oid, 'MEMBER') FROM pg_roles WHERE rolname = $1",
    )
    .bind(role)
    .fetch_optional(pool)
    .await
    .map_err(|error| refuse(error.to_string()))?;
    match member {
        None => Err(refuse("no such role".into())),
        Some(false) => Err(refuse(
            "the host's login role is not a member of it (GRANT it to the host's role)".into(),
        )),
        Some(true) => Ok(()),
    }
}

/// Compiles the pipeline's plugin on a blocking thread.
pub async fn load_plugin(
    runtime: &PluginRuntime,
    config: &PipelineConfig,
) -> Result<LoadedPlugin, PipelineError> {
    let path = config.plugin.clone();
    let compiling_runtime = runtime.clone();
    let loaded = tokio::task::spawn_blocking(move || compiling_runtime.load(&path))
        .await
        .unwrap_or_else(|join_error| {
            Err(PluginError::Invalid {
                path: config.plugin.clone(),
                reason: format!("compilation crashed: {join_error}"),
            })
        });
    loaded.map_err(|source| PipelineError::Plugin {
        pipeline: config.name.clone(),
        source,
    })
}

/// Consumes the pipeline's queue until `shutdown`, reconnecting to RabbitMQ with backoff.
/// Returns an error only for a refusal no retry can fix (credentials, vhost, TLS, a queue
/// declared otherwise): the host must stop and say which setting to change.
pub async fn consume(
    pipeline: Arc<Pipeline>,
    amqp: AmqpConfig,
    shutdown: CancellationToken,
) -> Result<(), AmqpError> {
    let name = pipeline.config.name.clone();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    while !shutdown.is_cancelled() {
        let opened = tokio::select! {
            opened = Session::open(&amqp, &pipeline.config) => opened,
            () = shutdown.cancelled() => return Ok(()),
        };
        let lost = match opened {
            Ok(session) => {
                info!(pipeline = %name, queue = %pipeline.config.queue, "Consuming.");
                backoff.reset();
                pipeline.consuming.store(true, Ordering::Relaxed);
                let served = serve(&pipeline, session, &shutdown).await;
                pipeline.consuming.store(false, Ordering::Relaxed);
                match served {
                    Ok(()) => return Ok(()),
                    Err(error) => error,
                }
            }
            Err(error) if error.is_refused() => return Err(error),
            Err(error) => error,
        };
        let delay = backoff.next_delay();
        warn!(
            pipeline = %name,
            error = %lost,
            retry_in_ms = delay.as_millis() as u64,
            "RabbitMQ unavailable; reconnecting."
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => return Ok(()),
        }
    }
    Ok(())
}

/// Feeds deliveries to at most `workers` concurrent tasks, up to `batch.size` deliveries per
/// task (gathered for at most `batch.linger`). On shutdown, stops consuming, lets every
/// started message finish and settle, then closes the connection.
async fn serve(
    pipeline: &Arc<Pipeline>,
    mut session: Session,
    shutdown: &CancellationToken,
) -> Result<(), AmqpError> {
    let workers = Arc::new(Semaphore::new(pipeline.config.workers.get()));
    let batch_size = pipeline.config.batch.size.get();
    let mut in_flight = JoinSet::new();
    let lost = |reason: String| AmqpError::ConsumerLost {
        queue: pipeline.config.queue.clone(),
        reason,
    };
    let ended = loop {
        while in_flight.try_join_next().is_some() {}
        if pipeline.paused().is_some() {
            // A configuration fault: take nothing more until the paused transaction works.
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break Ok(()),
                () = pipeline.unpaused() => {}
            }
        }
        let next = tokio::select! {
            biased;
            () = shutdown.cancelled() => break Ok(()),
            next = session.consumer.next() => next,
        };
        let first = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(error)) => break Err(lost(error.to_string())),
            None => break Err(lost("the broker cancelled the consumer".into())),
        };
        let permit = tokio::select! {
            permit = workers.clone().acquire_owned() => permit,
            // The delivery is not started: closing the connection returns it to the queue.
            () = shutdown.cancelled() => break Ok(()),
        };
        let Ok(permit) = permit else { break Ok(()) };
        let mut deliveries = vec![first];
        let mut gathering_ended = None;
        if batch_size > 1 {
            let deadline = tokio::time::Instant::now() + pipeline.config.batch.linger;
            while deliveries.len() < batch_size {
                let next = tokio::select! {
                    biased;
                    () = shutdown.cancelled() => break,
                    next = tokio::time::timeout_at(deadline, session.consumer.next()) => next,
                };
                match next {
                    Err(_linger_elapsed) => break,
                    Ok(Some(Ok(delivery))) => deliveries.push(delivery),
                    Ok(Some(Err(error))) => {
                        gathering_ended = Some(lost(error.to_string()));
                        break;
                    }
                    Ok(None) => {
                        gathering_ended = Some(lost("the broker cancelled the consumer".into()));
                        break;
                    }
                }
            }
        }
        let received: Vec<(InboundMessage, Receipt)> = deliveries
            .into_iter()
            .map(|delivery| amqp::receive(&pipeline.config.name, delivery, &session.acks))
            .collect();
        let pipeline = Arc::clone(pipeline);
        let channel = session.channel.clone();
        let shutdown = shutdown.clone();
        in_flight.spawn(async move {
            settle_batch(&pipeline, &channel, received, &shutdown).await;
            drop(permit);
        });
        if let Some(error) = gathering_ended {
            break Err(error);
        }
    };
    if ended.is_ok() {
        session.cancel().await;
    }
    while in_flight.join_next().await.is_some() {}
    session.close().await;
    ended
}

/// Decides the fate of a batch of deliveries (one transaction), then tells the broker:
/// rejections, retries and requeues first, then the acks.
async fn settle_batch(
    pipeline: &Pipeline,
    channel: &Channel,
    received: Vec<(InboundMessage, Receipt)>,
    shutdown: &CancellationToken,
) {
    let received_at = Instant::now();
    let dispositions = if let [(message, receipt)] = &received[..] {
        vec![process::handle_delivery(pipeline, message, receipt.attempt, shutdown).await]
    } else {
        let inputs: Vec<(&InboundMessage, u32)> = received
            .iter()
            .map(|(message, receipt)| (message, receipt.attempt))
            .collect();
        process::handle_batch(pipeline, &inputs, shutdown).await
    };
    let mut acks = Vec::new();
    for ((message, receipt), disposition) in received.iter().zip(dispositions) {
        let outcome = disposition.outcome();
        if let Disposition::Ack(settled) = disposition {
            debug!(pipeline = %pipeline.config.name, outcome = settled.as_str(), "Settled.");
            acks.push((receipt, outcome));
            continue;
        }
        let done = tell_broker(pipeline, channel, message, receipt, disposition, shutdown).await;
        report(pipeline, receipt, outcome, done, received_at);
    }
    // The channel's ack owner folds acks that arrive together into `multiple` acks.
    let acked = acks.iter().map(|(receipt, _)| receipt.ack());
    let acked = futures::future::join_all(acked).await;
    for ((receipt, outcome), done) in acks.iter().zip(acked) {
        Failpoint::AfterAck.hit();
        report(pipeline, receipt, outcome, done, received_at);
    }
}

/// Counts a settled delivery, and says so when its channel was gone.
fn report(
    pipeline: &Pipeline,
    receipt: &Receipt,
    outcome: &'static str,
    done: bool,
    received_at: Instant,
) {
    pipeline
        .metrics
        .message_settled(&pipeline.config.name, outcome, received_at.elapsed());
    if !done {
        warn!(
            pipeline = %pipeline.config.name,
            delivery_tag = receipt.delivery_tag,
            "Could not settle the delivery: its channel is gone. RabbitMQ will redeliver it; the claim makes that a duplicate."
        );
    }
}

/// Carries out a disposition other than a plain ack. Returns whether the broker got it.
async fn tell_broker(
    pipeline: &Pipeline,
    channel: &Channel,
    message: &InboundMessage,
    receipt: &Receipt,
    disposition: Disposition,
    shutdown: &CancellationToken,
) -> bool {
    let name = &pipeline.config.name;
    match disposition {
        Disposition::Ack(_) => receipt.ack().await,
        Disposition::DeadLetter { error_kind, reason } => {
            warn!(
                pipeline = %name,
                error_kind,
                %reason,
                message_id = message.message_id.as_deref().unwrap_or(""),
                dead_letter_queue = %pipeline.config.dead_letter_queue,
                "Message rejected and dead-lettered."
            );
            publish_or_requeue(
                receipt,
                receipt
                    .dead_letter(channel, &pipeline.config, error_kind, &reason)
                    .await,
            )
            .await
        }
        Disposition::Retry { attempt, reason } => {
            let delay = retry_delay(attempt);
            debug!(pipeline = %name, attempt, %reason, delay_ms = delay.as_millis() as u64, "Plugin asked for a retry.");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.cancelled() => {}
            }
            publish_or_requeue(
                receipt,
                receipt
                    .retry(channel, &pipeline.config.queue, attempt)
                    .await,
            )
            .await
        }
        Disposition::Requeue => {
            publish_or_requeue(
                receipt,
                receipt.requeue(channel, &pipeline.config.queue).await,
            )
            .await
        }
    }
}

/// The copy's fate; when the copy could not be published, the original goes back with a
/// `nack` (or, with its channel gone, is redelivered by the broker).
async fn publish_or_requeue(receipt: &Receipt, published: Result<bool, AmqpError>) -> bool {
    match published {
        Ok(acked) => acked,
        Err(error) => {
            warn!(%error, "Cannot move the message; returning it to its queue.");
            receipt.nack_requeue().await
        }
    }
}

/// Delay before a retryable failure is tried again: 200 ms doubling per attempt, at most 10 s.
fn retry_delay(attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(2).min(6);
    Duration::from_millis(200 * (1u64 << exponent)).min(Duration::from_secs(10))
}
