//! `idem cleanup`: one retention pass now.

use idem_host::config::Config;
use idem_host::store::tables::Tables;
use idem_host::store::{database, retention};

use crate::exit::Exit;
use crate::lookup::ConfigArg;

/// Delete claims older than each pipeline's retention window, in batches, once.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        let mut busy = false;
        for (name, database_config, prefix) in crate::lookup::each_database(&config) {
            let pool = database::connect_once(database_config).await?;
            let pipelines_in = config.pipelines_in(name);
            retention::record_consumers(&pool, database_config, &pipelines_in).await?;
            let pipelines: Vec<_> = pipelines_in
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
            let tables = Tables::of(database_config);
            match retention::clean_all(&pool, &tables, &pipelines, None, &never).await? {
                retention::Pass::Cleaned(deleted) => {
                    for (consumer, count) in deleted {
                        println!("{prefix}consumer {consumer:?}: {count} claims deleted");
                    }
                }
                retention::Pass::Partitions(maintenance) => println!(
                    "{prefix}partitions created {:?}, dropped {:?}",
                    maintenance.created, maintenance.dropped
                ),
                retention::Pass::Busy => {
                    println!("{prefix}another idem host is cleaning right now; nothing done");
                    busy = true;
                }
            }
            pool.close().await;
        }
        Ok(if busy {
            Exit::Unavailable
        } else {
            Exit::Success
        })
    }
}
