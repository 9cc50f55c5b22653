//! `idem cleanup`: one retention pass now.

use std::process::ExitCode;

use idem_host::config::Config;
use idem_host::store::{database, retention};

use crate::ConfigArg;

/// Delete claims older than each pipeline's retention window, in batches, once.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        let config = Config::load(&self.config.config)?;
        let pool = database::connect_once(&config.database).await?;
        retention::record_consumers(&pool, &config.database, &config.pipelines).await?;
        let pipelines: Vec<_> = config
            .pipelines
            .iter()
            .map(|pipeline| {
                (
                    pipeline.name.clone(),
                    pipeline.consumer.clone(),
                    pipeline.retention.clone(),
                )
            })
            .collect();
        let never = tokio_util::sync::CancellationToken::new();
        match retention::clean_all(&pool, &pipelines, None, &never).await? {
            retention::Pass::Cleaned(deleted) => {
                for (consumer, count) in deleted {
                    println!("consumer {consumer:?}: {count} claims deleted");
                }
                Ok(ExitCode::SUCCESS)
            }
            retention::Pass::Partitions(maintenance) => {
                println!(
                    "partitions created {:?}, dropped {:?}",
                    maintenance.created, maintenance.dropped
                );
                Ok(ExitCode::SUCCESS)
            }
            retention::Pass::Busy => {
                println!("another idem host is cleaning right now; nothing done");
                Ok(ExitCode::FAILURE)
            }
        }
    }
}
