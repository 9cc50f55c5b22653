//! `idem partition`: convert processed_messages to daily partitions.

use idem_host::config::{Config, RetentionConfig};
use idem_host::store::tables::Tables;
use idem_host::store::{database, partition, retention};

use crate::exit::Exit;
use crate::lookup::ConfigArg;

/// Convert processed_messages to daily partitions (keeps every claim; run before starting hosts).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        for (name, database_config, prefix) in crate::lookup::each_database(&config) {
            // One session, so the check for connected hosts can tell this one apart.
            let mut one_session = database_config.clone();
            one_session.max_connections = std::num::NonZeroU32::MIN;
            let pool = database::connect_once(&one_session).await?;
            let tables = Tables::of(database_config);
            let pipelines = config.pipelines_in(name);
            retention::record_consumers(&pool, database_config, &pipelines).await?;
            let converted = match partition::convert(&pool, &tables).await? {
                partition::Conversion::HostsConnected { sessions } => {
                    eprintln!(
                        "idem partition: {prefix}refused: {sessions} idem host session(s) are connected to this database; \
                         stop every host first (a running host would keep the unpartitioned claim form)"
                    );
                    return Ok(Exit::Failure);
                }
                partition::Conversion::Converted => true,
                partition::Conversion::AlreadyPartitioned => false,
            };
            // Partitions hold every consumer's claims: kept for the longest window.
            let window = pipelines
                .iter()
                .map(|pipeline| pipeline.retention.window)
                .max()
                .unwrap_or_else(|| RetentionConfig::default().window);
            let maintenance = partition::maintain(&pool, &tables, window).await?;
            pool.close().await;
            println!(
                "{prefix}processed_messages {} partitioned by day; created {:?}, dropped {:?}",
                if converted { "is now" } else { "was already" },
                maintenance.created,
                maintenance.dropped
            );
        }
        Ok(Exit::Success)
    }
}
