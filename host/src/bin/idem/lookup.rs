//! What the commands look up the same way: the pipelines file they read (`--config`), every
//! database of it with the prefix its lines take, a pipeline by name, and a pipeline's
//! statements as PostgreSQL prepares them (or as the config declares them, offline).

use std::path::PathBuf;

use idem_host::config::{Config, DatabaseConfig, PipelineConfig};
use idem_host::store::database;
use idem_host::store::statement::StatementCatalog;

use crate::exit::UsageError;

/// The pipelines file a command reads.
#[derive(clap::Args)]
pub struct ConfigArg {
    /// The pipelines file.
    #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
    pub config: PathBuf,
}

/// Every database of `config` (`[database]` first), with the prefix a command's lines about
/// it take: `[databases.billing]: ` when there are several, nothing when there is one.
pub fn each_database(
    config: &Config,
) -> impl Iterator<Item = (Option<&str>, &DatabaseConfig, String)> {
    let several = !config.databases.is_empty();
    config.all_databases().map(move |(name, database)| {
        let prefix = if several {
            format!("{}: ", idem_host::store::database::label(name))
        } else {
            String::new()
        };
        (name, database, prefix)
    })
}

/// The pipeline `name` of `config`, or an error listing the ones it has.
pub fn pipeline_named<'config>(
    config: &'config Config,
    name: &str,
) -> anyhow::Result<&'config PipelineConfig> {
    config.pipeline(name).ok_or_else(|| {
        let known: Vec<&str> = config
            .pipelines
            .iter()
            .map(|pipeline| pipeline.name.as_str())
            .collect();
        UsageError(format!(
            "no pipeline {name:?} in {} (it has: {})",
            config.path.display(),
            known.join(", ")
        ))
        .into()
    })
}

/// The pipeline's statements as PostgreSQL prepares them, or, when it is out of reach (or
/// `offline`), as the config declares them: names and parameter counts only.
pub async fn statements(
    config: &Config,
    pipeline_config: &PipelineConfig,
    offline: bool,
) -> StatementCatalog {
    if offline {
        return StatementCatalog::from_config(pipeline_config);
    }
    let database = match database::open(config.database_of(pipeline_config)).await {
        Ok(database) => database,
        Err(error) => {
            eprintln!(
                "idem: PostgreSQL is out of reach ({error}); effects are checked for statement names and parameter counts, not types"
            );
            return StatementCatalog::from_config(pipeline_config);
        }
    };
    let prepared = StatementCatalog::prepare(&database.sessions, pipeline_config).await;
    database.pool.close().await;
    database.sessions.close_idle();
    prepared.unwrap_or_else(|errors| {
        eprintln!(
            "idem: pipeline {:?} has statements that do not prepare ({errors}); effects are checked for names and parameter counts only",
            pipeline_config.name
        );
        StatementCatalog::from_config(pipeline_config)
    })
}
