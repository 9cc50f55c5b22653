//! `idem pause` and `idem resume`: a pipeline paused on every host of its consumer, recorded
//! in the database (`pipeline::pause`), or resumed.

use idem_host::config::Config;
use idem_host::pipeline::pause::WATCH_EVERY;
use idem_host::store::tables::Tables;
use idem_host::store::{database, pauses};

use crate::exit::Exit;
use crate::lookup::ConfigArg;
use crate::lookup::pipeline_named;

/// Pause a pipeline on every host that runs it, until `idem resume`: each stops consuming
/// within seconds, lets the messages it started settle, and gives back what it prefetched.
/// Restarted hosts stay paused.
#[derive(clap::Args)]
pub struct PauseArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// The pipeline to pause.
    #[arg(long, short)]
    pipeline: String,
    /// Why, for the console, /admin/status and the other operators.
    #[arg(long)]
    reason: Option<String>,
}

/// Resume a pipeline paused by `idem pause` (or by the admin API, on every host).
#[derive(clap::Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// The pipeline to resume.
    #[arg(long, short)]
    pipeline: String,
}

impl PauseArgs {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        let pipeline = pipeline_named(&config, &self.pipeline)?;
        let database_config = config.database_of(pipeline);
        let pool = database::connect_once(database_config).await?;
        let reason = self
            .reason
            .as_deref()
            .map(str::trim)
            .filter(|reason| !reason.is_empty())
            .unwrap_or("paused with idem pause");
        pauses::record(
            &pool,
            &Tables::of(database_config),
            &pipeline.consumer,
            pipeline.retention.window,
            reason,
        )
        .await?;
        pool.close().await;
        println!(
            "pipeline {:?} (consumer {:?}) paused: every host running it stops consuming within {} s and stays paused, restarts included, until `idem resume --pipeline {}`",
            pipeline.name,
            pipeline.consumer,
            WATCH_EVERY.as_secs(),
            pipeline.name
        );
        Ok(Exit::Success)
    }
}

impl ResumeArgs {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        let pipeline = pipeline_named(&config, &self.pipeline)?;
        let database_config = config.database_of(pipeline);
        let pool = database::connect_once(database_config).await?;
        let cleared =
            pauses::clear(&pool, &Tables::of(database_config), &pipeline.consumer).await?;
        pool.close().await;
        if cleared {
            println!(
                "pipeline {:?} resumed: every host running it consumes again within {} s",
                pipeline.name,
                WATCH_EVERY.as_secs()
            );
        } else {
            println!(
                "pipeline {:?} had no recorded pause (a pause on one host only ends with POST /admin/pipelines/{}/resume or the console)",
                pipeline.name, pipeline.name
            );
        }
        Ok(Exit::Success)
    }
}
