//! `idem status`: how each pipeline is doing: its plugin build, what its source holds, its
//! dead letters and claims.

use std::path::Path;
use std::process::ExitCode;

use idem_host::config::Config;
use idem_host::sandbox::contract;
use idem_host::source;
use idem_host::store::tables::Tables;
use idem_host::store::{database, retention};

use crate::lookup::ConfigArg;

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
    // Every database, reachable or not, with where idem's tables are in it.
    let mut databases = Vec::new();
    for (name, database_config) in config.all_databases() {
        let pool = database::connect_once(database_config).await.ok();
        databases.push((name, pool, Tables::of(database_config)));
    }
    for pipeline_config in &config.pipelines {
        let (_, pool, tables) = databases
            .iter()
            .find(|(name, ..)| *name == pipeline_config.database.as_deref())
            .expect("the config names only databases it has");
        println!(
            "pipeline {:?} (consumer {:?})",
            pipeline_config.name, pipeline_config.consumer
        );
        if let Some(name) = &pipeline_config.database {
            println!("  database      {}", database::label(Some(name)));
        }
        println!(
            "  plugin file   {} ({})",
            pipeline_config.plugin.display(),
            plugin_build(&pipeline_config.plugin)
        );
        for line in source::status(pipeline_config).await {
            println!("  {:<13} {:?}: {}", line.label, line.name, line.state);
        }
        if let Some(pool) = pool {
            let claims = retention::claims_summary(pool, tables, &pipeline_config.consumer).await;
            match claims {
                Ok(claims) => println!(
                    "  claims        {} (oldest {}, window {:?})",
                    claims.rows,
                    claims.oldest_age.map_or("-".to_string(), |age| format!(
                        "{:.0} s ago",
                        age.as_secs_f64()
                    )),
                    pipeline_config.retention.window
                ),
                Err(error) => println!("  claims        unknown ({error})"),
            }
        }
    }
    let several = databases.len() > 1;
    for (name, pool, tables) in &databases {
        // `outbox of [databases.billing]: …` when there are several.
        let of = if several {
            format!(" of {}", database::label(*name))
        } else {
            String::new()
        };
        match pool {
            Some(pool) if config.outbox.is_some() => {
                match idem_host::store::outbox::backlog(pool, tables).await {
                    Ok(backlog) => println!(
                        "outbox{of}: {} pending, {} parked, {} delivered (kept for retention)",
                        backlog.pending, backlog.parked, backlog.delivered
                    ),
                    Err(error) => println!("outbox{of}: unknown ({error})"),
                }
            }
            Some(_) => {}
            None => println!(
                "({} unreachable: its claims not shown)",
                database::label(*name)
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The plugin file's build and the contract it was built for, read without compiling it.
fn plugin_build(path: &Path) -> String {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) => return format!("unreadable: {error}"),
    };
    let contract = contract::of_component(&bytes).map_or_else(
        || format!("no {} contract", contract::PACKAGE),
        |version| contract::describe(&version),
    );
    format!("{}, {contract}", idem_host::sandbox::digest(&bytes))
}
