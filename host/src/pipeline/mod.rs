//! One pipeline at run time: its config, plugin, statements, sessions and pause state, built and
//! checked at start. The consume loop that feeds it deliveries is `consume`; each delivery is
//! handled by `process`, its tries by `retries`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use sqlx::PgPool;
use tracing::{debug, error, info, warn};

use crate::cases;
use crate::config::{ClaimMode, Isolation, PipelineConfig};
use crate::effect::Outcome;
use crate::relay::RelayWaker;
use crate::sandbox::{LoadedPlugin, PluginError, PluginRuntime};
use crate::source::standing::Lent;
use crate::store::bookkeeping;
use crate::store::database::Database;
use crate::store::offsets::Offsets;
use crate::store::session::SessionPool;
use crate::store::statement::{StatementCatalog, StatementErrors};
use crate::store::tables::Tables;
use crate::telemetry::metrics::Metrics;

pub mod batch_size;
pub mod consume;
mod disposition;
pub mod pause;
pub mod process;
pub mod reload;
mod retries;

pub use pause::OperatorPause;
use pause::{Followed, OperatorSwitch, Reading};
pub use reload::ReloadStatus;
use reload::Reloads;

/// Everything a worker needs to handle a message of this pipeline.
pub struct Pipeline {
    config: PipelineConfig,
    runtime: PluginRuntime,
    /// The plugin serving new messages; a message in flight keeps the version it started with.
    plugin: ArcSwap<LoadedPlugin>,
    statements: StatementCatalog,
    /// The sessions its transactions run on (shared by every pipeline).
    sessions: SessionPool,
    /// What its source is lent at every opening: where its consumer resumes in a log read by
    /// offset (Kafka, beside its claims), and where it says how it stands.
    lent: Lent,
    metrics: Arc<Metrics>,
    /// Its reloads: one at a time, the last one's outcome kept for the admin status.
    reloads: Reloads,
    /// True while a consumer is subscribed to the queue.
    consuming: AtomicBool,
    /// `processed_messages` is partitioned by day: claims use the partition-safe form.
    partitioned_claims: bool,
    /// Wakes this host's outbox relay after a commit that wrote outbox rows.
    relay: RelayWaker,
    /// Held while a batch of several messages is applied: a multi-message transaction holds
    /// many row locks, and two of them in parallel deadlock on shared rows (one customer's
    /// balance). Plugin calls and single-message transactions still run in parallel.
    batch_applier: tokio::sync::Mutex<()>,
    /// `Some` while a configuration fault pauses the pipeline: no new deliveries are taken
    /// until a retry of the failing transaction succeeds.
    paused: tokio::sync::watch::Sender<Option<Paused>>,
    /// Held by the one transaction that keeps trying while a configuration fault pauses the
    /// pipeline (the probe that resumes it); the others give their messages back to the
    /// queue, for healthy hosts, instead of waiting here with them.
    probing: AtomicBool,
    /// `Some` while an operator has paused the pipeline: it consumes nothing (its connection
    /// closed, what it had prefetched back on the queue) until resumed.
    operator_pause: OperatorSwitch,
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
        database: &Database,
        metrics: Arc<Metrics>,
        relay: RelayWaker,
    ) -> Result<Pipeline, PipelineError> {
        let plugin = load_plugin(&runtime, &config).await?;
        let statements = StatementCatalog::prepare(&database.sessions, &config).await?;
        self_test(&runtime, &config, &statements, &plugin).await?;
        let partitioned_claims =
            crate::store::partition::is_partitioned(&database.pool, &database.tables)
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
            check_role(&database.pool, &config.name, role).await?;
        }
        info!(
            pipeline = %config.name,
            plugin = %plugin.path.display(),
            digest = %plugin.digest,
            compiled = plugin.compiled.as_str(),
            statements = config.statements.len(),
            "Pipeline ready."
        );
        // Both pause gauges are there from the start, at 0, for the alert rules.
        metrics.pipeline_paused(&config.name, false);
        metrics.pipeline_operator_paused(&config.name, false);
        let offsets = Offsets::new(
            database.pool.clone(),
            Tables::clone(&database.tables),
            &config.consumer,
        );
        Ok(Pipeline {
            config,
            runtime,
            plugin: ArcSwap::from_pointee(plugin),
            statements,
            sessions: database.sessions.clone(),
            lent: Lent {
                offsets,
                standing: Arc::default(),
            },
            metrics,
            reloads: Reloads::default(),
            consuming: AtomicBool::new(false),
            partitioned_claims,
            relay,
            batch_applier: tokio::sync::Mutex::new(()),
            paused: tokio::sync::watch::Sender::new(None),
            probing: AtomicBool::new(false),
            operator_pause: OperatorSwitch::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn config(&self) -> &PipelineConfig {
        &self.config
    }

    /// The counters it records into (the host's).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The plugin build serving new messages.
    pub fn plugin(&self) -> Arc<LoadedPlugin> {
        self.plugin.load_full()
    }

    /// Whether a consumer is subscribed to its queue now.
    pub fn is_consuming(&self) -> bool {
        self.consuming.load(Ordering::Relaxed)
    }

    /// Why its open source receives nothing now, as the source says (Kafka: its brokers
    /// unreachable and no partition assigned).
    pub fn source_problem(&self) -> Option<String> {
        self.lent.standing.problem()
    }

    /// Rebalances of its consumer group served, since the host started (Kafka).
    pub fn source_rebalances(&self) -> u64 {
        self.lent.standing.rebalances()
    }

    /// What its last reload attempt did.
    pub fn reload_status(&self) -> ReloadStatus {
        self.reloads.status()
    }

    /// Whether its claims table is partitioned by day (claims take the partition-safe form).
    pub fn partitioned_claims(&self) -> bool {
        self.partitioned_claims
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

    /// Becomes the transaction that keeps trying while the pipeline is paused, if no other
    /// is. Returns whether it did; `release_probe` gives the role up.
    pub(crate) fn take_probe(&self) -> bool {
        self.probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether a transaction keeps trying while the pipeline is paused.
    pub(crate) fn probing(&self) -> bool {
        self.probing.load(Ordering::Acquire)
    }

    /// The probing transaction finished or gave its message up.
    pub(crate) fn release_probe(&self) {
        self.probing.store(false, Ordering::Release);
    }

    /// Why the pipeline is paused, if it is.
    pub fn paused(&self) -> Option<Paused> {
        self.paused.borrow().clone()
    }

    /// Returns once the pipeline is not paused.
    pub(crate) async fn unpaused(&self) {
        let mut receiver = self.paused.subscribe();
        let _ = receiver.wait_for(Option::is_none).await;
    }

    /// An operator pauses the pipeline: it stops consuming once the messages it started are
    /// settled. Returns whether it was running.
    pub fn pause_by_operator(&self, pause: OperatorPause) -> bool {
        let newly = self.operator_pause.pause(pause.clone());
        self.operator_paused_says(&pause, newly);
        newly
    }

    /// An operator resumes the pipeline; the pause it ends, if there was one.
    pub fn resume_by_operator(&self) -> Option<OperatorPause> {
        let ended = self.operator_pause.resume();
        if ended.is_some() {
            self.operator_resumed_says();
        }
        ended
    }

    /// The operator's pause, if the pipeline is paused by one.
    pub fn operator_pause(&self) -> Option<OperatorPause> {
        self.operator_pause.current()
    }

    /// Reads the operator's pause before the recorded pauses are read (`follow_record`).
    pub(crate) fn read_operator_pause(&self) -> Reading {
        self.operator_pause.read()
    }

    /// Follows this pipeline's recorded pause (`None`: no record), read after `reading`:
    /// pauses or resumes it, unless an operator did either since.
    pub(crate) fn follow_record(&self, reading: Reading, record: Option<OperatorPause>) {
        match self.operator_pause.follow_record(reading, record) {
            Followed::Paused(pause) => self.operator_paused_says(&pause, true),
            Followed::Resumed => self.operator_resumed_says(),
            Followed::Nothing => {}
        }
    }

    fn operator_paused_says(&self, pause: &OperatorPause, newly: bool) {
        self.metrics.pipeline_operator_paused(self.name(), true);
        if newly {
            warn!(
                pipeline = %self.name(),
                reason = %pause.reason,
                persistent = pause.persistent,
                "Pipeline paused by an operator: it consumes nothing until resumed."
            );
        }
    }

    fn operator_resumed_says(&self) {
        self.metrics.pipeline_operator_paused(self.name(), false);
        info!(pipeline = %self.name(), "Pipeline resumed by an operator.");
    }

    /// Returns once an operator pauses the pipeline.
    pub(crate) async fn operator_paused(&self) {
        self.operator_pause.paused().await;
    }

    /// Returns once no operator's pause holds the pipeline.
    pub(crate) async fn operator_resumed(&self) {
        self.operator_pause.resumed().await;
    }
}

/// Runs `plugin` on the pipeline's self-test message and case file, if it has them: on the
/// message the plugin must decide or skip, every case must pass, and every effect must fit
/// its statement.
pub async fn self_test(
    runtime: &PluginRuntime,
    config: &PipelineConfig,
    statements: &StatementCatalog,
    plugin: &LoadedPlugin,
) -> Result<(), PipelineError> {
    let refuse = |path: &std::path::Path, reason: String| PipelineError::SelfTest {
        pipeline: config.name.clone(),
        digest: plugin.digest.clone(),
        path: path.to_path_buf(),
        reason,
    };
    if let Some(path) = &config.self_test {
        let body = tokio::fs::read(path)
            .await
            .map_err(|error| refuse(path, format!("cannot read the message: {error}")))?;
        let message = cases::Origin::of(config).message(body, config.queue());
        match runtime.invoke(plugin, &config.limits, &message).await {
            Ok(Outcome::Skip { .. }) => {}
            Ok(Outcome::Decision(decision)) => {
                cases::fit(config, statements, &decision)
                    .map_err(|error| refuse(path, error.to_string()))?;
            }
            Err(error) => return Err(refuse(path, error.to_string())),
        }
    }
    if let Some(path) = &config.cases {
        let cases = cases::load(path).map_err(|error| refuse(path, error.to_string()))?;
        let trial = cases::Trial {
            runtime,
            plugin,
            limits: &config.limits,
            origin: cases::Origin::of(config),
            fit: Some((config, statements)),
        };
        let mut failures = Vec::new();
        for case in &cases {
            let differences = trial.differences(case).await;
            if !differences.is_empty() {
                failures.push(format!("case {:?}: {}", case.name, differences.join("; ")));
            }
        }
        if !failures.is_empty() {
            return Err(refuse(
                path,
                format!(
                    "{} of {} case(s) failed: {}",
                    failures.len(),
                    cases.len(),
                    failures.join(" | ")
                ),
            ));
        }
    }
    Ok(())
}

/// The host's login role must be able to `SET ROLE` to `role`.
async fn check_role(pool: &PgPool, pipeline: &str, role: &str) -> Result<(), PipelineError> {
    let refuse = |reason: String| PipelineError::Role {
        pipeline: pipeline.to_string(),
        role: role.to_string(),
        reason,
    };
    let member: Option<bool> = bookkeeping::in_transaction(pool, async |connection| {
        bookkeeping::query_scalar(
            "SELECT pg_has_role(current_user, oid, 'MEMBER') FROM pg_roles WHERE rolname = $1",
        )
        .bind(role)
        .fetch_optional(connection)
        .await
    })
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
    runtime
        .compile(&config.plugin, None)
        .await
        .map_err(|source| PipelineError::Plugin {
            pipeline: config.name.clone(),
            source,
        })
}
