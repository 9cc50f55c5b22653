//! `idem test`: a plugin on every case of a case file, each difference shown.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use idem_host::cases::{self, Origin, Trial};
use idem_host::config::{Config, PipelineConfig, PluginLimits, SourceConfig};
use idem_host::pipeline;
use idem_host::sandbox::{LoadedPlugin, PluginRuntime};
use idem_host::store::statement::StatementCatalog;

use crate::lookup::{pipeline_named, statements};

/// Run a plugin on every case of a case file and show each difference from the expected
/// outcome (exit 1 on any); with --config, also check every effect against the pipeline.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    target: TestTarget,
    /// The case file (JSON: messages and expected outcomes).
    #[arg(long, default_value = "cases.json")]
    cases: PathBuf,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        test(self.target, &self.cases).await
    }
}

/// Where `idem test` takes its plugin, limits and statements from.
#[derive(clap::Args)]
struct TestTarget {
    /// The plugin (default: the pipeline's, with --config).
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// A pipelines file whose pipeline's limits and statements to test against.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The pipeline in --config (needed when it has several).
    #[arg(long, short)]
    pipeline: Option<String>,
    /// Check effects against the config's statements without contacting PostgreSQL.
    #[arg(long)]
    offline: bool,
}

/// What `idem test` runs the cases with: the plugin, and with `--config` the pipeline it
/// serves and that pipeline's statements.
struct Subject {
    runtime: PluginRuntime,
    plugin: LoadedPlugin,
    pipeline_config: Option<PipelineConfig>,
    statements: Option<StatementCatalog>,
}

impl Subject {
    async fn of(target: &TestTarget) -> anyhow::Result<Subject> {
        let Some(config_path) = &target.config else {
            let path = target
                .plugin
                .clone()
                .context("name the plugin with --plugin X.wasm (or a pipeline with --config)")?;
            let runtime = PluginRuntime::new()?;
            let plugin = runtime.compile(&path, None).await?;
            return Ok(Subject {
                runtime,
                plugin,
                pipeline_config: None,
                statements: None,
            });
        };
        let config = Config::load(config_path)?;
        let mut pipeline_config = match &target.pipeline {
            Some(name) => pipeline_named(&config, name)?.clone(),
            None => match &config.pipelines[..] {
                [only] => only.clone(),
                _ => anyhow::bail!(
                    "{} has {} pipelines: name one with --pipeline",
                    config.path.display(),
                    config.pipelines.len()
                ),
            },
        };
        if let Some(plugin) = &target.plugin {
            pipeline_config.plugin = plugin.clone();
        }
        let runtime = PluginRuntime::for_config(&config)?;
        let plugin = pipeline::load_plugin(&runtime, &pipeline_config).await?;
        let statements = statements(&config, &pipeline_config, target.offline).await;
        Ok(Subject {
            runtime,
            plugin,
            pipeline_config: Some(pipeline_config),
            statements: Some(statements),
        })
    }
}

async fn test(target: TestTarget, cases_path: &Path) -> anyhow::Result<ExitCode> {
    let cases = cases::load(cases_path)?;
    let Subject {
        runtime,
        plugin,
        pipeline_config,
        statements,
    } = Subject::of(&target).await?;
    let checked_against = match (&pipeline_config, &statements) {
        (Some(pipeline_config), Some(statements)) => format!(
            "; effects checked against pipeline {:?} ({})",
            pipeline_config.name,
            if statements.types_known() {
                "names, parameter counts and types from PostgreSQL"
            } else {
                "names and parameter counts; no database, so types unchecked"
            }
        ),
        _ => String::new(),
    };
    println!(
        "idem test: {} ({}) against {}{checked_against}",
        plugin.path.display(),
        plugin.digest,
        cases_path.display()
    );
    let default_limits = PluginLimits::default();
    let run = Trial {
        runtime: &runtime,
        plugin: &plugin,
        limits: pipeline_config
            .as_ref()
            .map_or(&default_limits, |pipeline_config| &pipeline_config.limits),
        origin: pipeline_config.as_ref().map_or(
            Origin {
                pipeline: "test",
                source: SourceConfig::RABBITMQ,
                queue: "",
            },
            Origin::of,
        ),
        fit: pipeline_config.as_ref().zip(statements.as_ref()),
    };
    let mut failed = 0;
    for case in &cases {
        let differences = run.differences(case).await;
        if differences.is_empty() {
            println!("ok   {}", case.name);
        } else {
            failed += 1;
            println!("FAIL {}", case.name);
            for difference in differences {
                println!("       {difference}");
            }
        }
    }
    println!(
        "{} case(s): {} passed, {failed} failed",
        cases.len(),
        cases.len() - failed
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
