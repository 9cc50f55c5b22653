//! `idem check`: is this config ready to run.

use std::path::Path;
use std::process::ExitCode;

use idem_host::config::Config;
use idem_host::pipeline;
use idem_host::sandbox::{LoadedPlugin, PluginRuntime, contract};
use idem_host::source::{self, Finding};
use idem_host::store::database;
use idem_host::store::statement::StatementCatalog;

use crate::lookup::ConfigArg;

/// Validate the config, compile every plugin, prepare every statement, and check RabbitMQ
/// (credentials, vhost, every queue's existence and arguments); list every problem.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    /// Check the file and the plugins only; contact neither PostgreSQL nor RabbitMQ.
    #[arg(long)]
    offline: bool,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        check(&self.config.config, self.offline).await
    }
}

/// Collects every problem instead of stopping at the first.
async fn check(path: &Path, offline: bool) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let runtime = PluginRuntime::for_config(&config)?;
    let mut problems = Vec::new();
    if let Some(outbox) = &config.outbox
        && let Err(error) = idem_host::relay::http_clients(outbox)
    {
        problems.push(error.to_string());
    }
    let plugins = load_plugins(&runtime, &config, &mut problems).await;
    // The statements each pipeline's self-test is checked against: as PostgreSQL prepares
    // them, or, offline, as the config declares them.
    let catalogs: Vec<Option<StatementCatalog>> = if offline {
        config
            .pipelines
            .iter()
            .map(|pipeline_config| Some(StatementCatalog::from_config(pipeline_config)))
            .collect()
    } else {
        for finding in source::check(&config).await {
            match finding {
                Finding::Ok(line) => println!("ok   {line}"),
                Finding::Problem(problem) => problems.push(problem),
            }
        }
        prepare_statements(&config, &mut problems).await
    };
    for ((pipeline_config, plugin), catalog) in config.pipelines.iter().zip(&plugins).zip(&catalogs)
    {
        let (Some(plugin), Some(catalog)) = (plugin, catalog) else {
            continue;
        };
        if pipeline_config.self_test.is_none() && pipeline_config.cases.is_none() {
            continue;
        }
        match pipeline::self_test(&runtime, pipeline_config, catalog, plugin).await {
            Ok(()) => println!(
                "ok   pipeline {:?}: plugin passes its self-test",
                pipeline_config.name
            ),
            Err(error) => problems.push(error.to_string()),
        }
    }
    let note = if offline {
        " (offline: PostgreSQL and the brokers not checked; effects checked for statement names and parameter counts)"
    } else {
        ""
    };
    Ok(verdict(&config, &problems, note))
}

/// Each pipeline's plugin, compiled and checked against the contract; `None` for one that
/// failed, with its problem.
async fn load_plugins(
    runtime: &PluginRuntime,
    config: &Config,
    problems: &mut Vec<String>,
) -> Vec<Option<LoadedPlugin>> {
    let mut plugins = Vec::with_capacity(config.pipelines.len());
    for pipeline_config in &config.pipelines {
        match pipeline::load_plugin(runtime, pipeline_config).await {
            Ok(plugin) => {
                println!(
                    "ok   pipeline {:?}: plugin {} ({}, {})",
                    pipeline_config.name,
                    plugin.path.display(),
                    plugin.digest,
                    contract::describe(&plugin.contract)
                );
                if let Some(deprecation) = contract::deprecation(&plugin.contract) {
                    println!(
                        "warn pipeline {:?}: plugin {deprecation}",
                        pipeline_config.name
                    );
                }
                plugins.push(Some(plugin));
            }
            Err(error) => {
                problems.push(error.to_string());
                plugins.push(None);
            }
        }
    }
    plugins
}

/// Connects to every database, checks idem's tables in each, and prepares each pipeline's
/// statements in its database; `None` for a pipeline whose statements failed, or whose
/// database cannot be reached, with their problems.
async fn prepare_statements(
    config: &Config,
    problems: &mut Vec<String>,
) -> Vec<Option<StatementCatalog>> {
    let mut opened = Vec::new();
    for (name, database_config) in config.all_databases() {
        match database::open(database_config).await {
            Ok(database) => {
                let outbox = config.outbox.is_some();
                match database::check_schema(&database.pool, database_config, outbox).await {
                    Ok(()) => println!(
                        "ok   {}: idem's tables in {}",
                        database::label(name),
                        database.tables.place()
                    ),
                    Err(error) => problems.push(error.to_string()),
                }
                opened.push((name, Some(database)));
            }
            Err(error) => {
                problems.push(error.to_string());
                opened.push((name, None));
            }
        }
    }
    let mut catalogs = Vec::with_capacity(config.pipelines.len());
    for pipeline_config in &config.pipelines {
        let database = opened
            .iter()
            .find(|(name, _)| *name == pipeline_config.database.as_deref())
            .and_then(|(_, database)| database.as_ref());
        let Some(database) = database else {
            catalogs.push(None);
            continue;
        };
        match StatementCatalog::prepare(&database.sessions, pipeline_config).await {
            Ok(catalog) => {
                println!(
                    "ok   pipeline {:?}: {} statements prepare",
                    pipeline_config.name,
                    pipeline_config.statements.len()
                );
                catalogs.push(Some(catalog));
            }
            Err(errors) => {
                problems.extend(errors.0.iter().map(ToString::to_string));
                catalogs.push(None);
            }
        }
    }
    catalogs
}

fn verdict(config: &Config, problems: &[String], note: &str) -> ExitCode {
    for problem in problems {
        println!("FAIL {problem}");
    }
    if problems.is_empty() {
        println!("{} is ready to run{note}", config.path.display());
        ExitCode::SUCCESS
    } else {
        println!("{} problem(s) found{note}", problems.len());
        ExitCode::FAILURE
    }
}
