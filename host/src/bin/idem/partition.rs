//! `idem partition`: convert processed_messages to daily partitions.

use std::process::ExitCode;

use idem_host::config::Config;
use idem_host::store::{database, partition, retention};

use crate::ConfigArg;

/// Convert processed_messages to daily partitions (keeps every claim; run before starting hosts).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        let config = Config::load(&self.config.config)?;
        // One session, so the check for connected hosts can tell this one apart.
        let mut database_config = config.database.clone();
        database_config.max_connections = std::num::NonZeroU32::MIN;
        let pool = database::connect_once(&database_config).await?;
        retention::record_consumers(&pool, &config.database, &config.pipelines).await?;
        let converted = match partition::convert(&pool).await? {
            partition::Conversion::HostsConnected { sessions } => {
                eprintln!(
                    "idem partition: refused: {sessions} idem host session(s) are connected to this database; \
                     stop every host first (a running host would keep the unpartitioned claim form)"
                );
                return Ok(ExitCode::FAILURE);
            }
            partition::Conversion::Converted => true,
            partition::Conversion::AlreadyPartitioned => false,
        };
        let window = config
            .pipelines
            .iter()
            .map(|pipeline| pipeline.retention.window)
            .max()
            .unwrap_or_default();
        let maintenance = partition::maintain(&pool, window).await?;
        println!(
            "processed_messages {} partitioned by day; created {:?}, dropped {:?}",
            if converted { "is now" } else { "was already" },
            maintenance.created,
            maintenance.dropped
        );
        Ok(ExitCode::SUCCESS)
    }
}
