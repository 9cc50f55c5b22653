//! `idem status`: how each pipeline is doing: its plugin build, what its source holds, its
//! dead letters and claims.

use std::path::Path;
use std::process::ExitCode;

use idem_host::config::Config;
use idem_host::source;
use idem_host::store::{bookkeeping, database};

use crate::ConfigArg;

/// Pipelines, plugin builds, queue and dead-letter depths, claims.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        status(&self.config.config).await
    }
}

async fn status(path: &Path) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let pool = database::connect_once(&config.database).await.ok();
    for pipeline_config in &config.pipelines {
        println!(
            "pipeline {:?} (consumer {:?})",
            pipeline_config.name, pipeline_config.consumer
        );
        let plugin = match std::fs::read(&pipeline_config.plugin) {
            Ok(bytes) => idem_host::sandbox::digest(&bytes),
            Err(error) => format!("unreadable: {error}"),
        };
        println!(
            "  plugin file   {} ({plugin})",
            pipeline_config.plugin.display()
        );
        for line in source::status(pipeline_config).await {
            println!("  {:<13} {:?}: {}", line.label, line.name, line.state);
        }
        if let Some(pool) = &pool {
            let claims: Result<(i64, Option<f64>), sqlx::Error> =
                bookkeeping::in_transaction(pool, async |connection| {
                    bookkeeping::query_as(
                        "SELECT count(*), extract(epoch FROM now() - min(processed_at))::float8 \
                         FROM processed_messages WHERE consumer = $1",
                    )
                    .bind(&pipeline_config.consumer)
                    .fetch_one(connection)
                    .await
                })
                .await;
            match claims {
                Ok((count, oldest)) => println!(
                    "  claims        {count} (oldest {}, window {:?})",
                    oldest.map_or("-".to_string(), |seconds| format!("{:.0} s ago", seconds)),
                    pipeline_config.retention.window
                ),
                Err(error) => println!("  claims        unknown ({error})"),
            }
        }
    }
    if let (Some(pool), Some(_)) = (&pool, &config.outbox) {
        match idem_host::store::outbox::backlog(pool).await {
            Ok(backlog) => println!(
                "outbox: {} pending, {} parked, {} delivered (kept for retention)",
                backlog.pending, backlog.parked, backlog.delivered
            ),
            Err(error) => println!("outbox: unknown ({error})"),
        }
    }
    if pool.is_none() {
        println!("(database unreachable: claims not shown)");
    }
    Ok(ExitCode::SUCCESS)
}
