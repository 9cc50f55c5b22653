//! `idem test`: a plugin on every case of a case file, each difference shown.

use std::path::{Path, PathBuf};

use idem_host::cases::{self, Origin, Trial};
use idem_host::config::{Config, PipelineConfig, PluginLimits, SourceConfig};
use idem_host::pipeline;
use idem_host::sandbox::{LoadedPlugin, PluginRuntime};
use idem_host::store::statement::StatementCatalog;

use crate::exit::{Exit, UsageError};
use crate::lookup::{pipeline_named, statements};
use crate::output::{FormatArg, print_json};

/// Run a plugin on every case of a case file and show each difference from the expected
/// outcome (exit 5 on any); with --config, also check every effect against the pipeline.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    target: TestTarget,
    /// The case file (JSON: messages and expected outcomes).
    #[arg(long, default_value = "cases.json")]
    cases: PathBuf,
    #[command(flatten)]
    pub format: FormatArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        test(self.target, &self.cases, self.format.is_json()).await
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
            let path = target.plugin.clone().ok_or_else(|| {
                UsageError(
                    "name the plugin with --plugin X.wasm (or a pipeline with --config)".into(),
                )
            })?;
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
                _ => {
                    return Err(UsageError(format!(
                        "{} has {} pipelines: name one with --pipeline",
                        config.path.display(),
                        config.pipelines.len()
                    ))
                    .into());
                }
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

async fn test(target: TestTarget, cases_path: &Path, json: bool) -> anyhow::Result<Exit> {
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
    if !json {
        println!(
            "idem test: {} ({}) against {}{checked_against}",
            plugin.path.display(),
            plugin.digest,
            cases_path.display()
        );
    }
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
    let mut results = Vec::with_capacity(cases.len());
    for case in &cases {
        let differences = run.differences(case).await;
        if !json {
            let verdict = if differences.is_empty() {
                "ok  "
            } else {
                "FAIL"
            };
            println!("{verdict} {}", case.name);
            for difference in &differences {
                println!("       {difference}");
            }
        }
        results.push((case.name.as_str(), differences));
    }
    verdict(
        &plugin,
        cases_path,
        pipeline_config.as_ref(),
        &results,
        json,
    )
}

/// The summary (or, for JSON, the whole report) and the exit: `Findings` if a case differs.
fn verdict(
    plugin: &LoadedPlugin,
    cases_path: &Path,
    pipeline_config: Option<&PipelineConfig>,
    results: &[(&str, Vec<String>)],
    json: bool,
) -> anyhow::Result<Exit> {
    let failed = results
        .iter()
        .filter(|(_, differences)| !differences.is_empty())
        .count();
    let passed = results.len() - failed;
    let exit = if failed == 0 {
        Exit::Success
    } else {
        Exit::Findings
    };
    if !json {
        println!(
            "{} case(s): {passed} passed, {failed} failed",
            results.len()
        );
        return Ok(exit);
    }
    let cases: Vec<_> = results
        .iter()
        .map(|(name, differences)| {
            serde_json::json!({
                "name": name,
                "passed": differences.is_empty(),
                "differences": differences,
            })
        })
        .collect();
    print_json(&serde_json::json!({
        "plugin": plugin.path.display().to_string(),
        "digest": plugin.digest,
        "cases_file": cases_path.display().to_string(),
        "pipeline": pipeline_config.map(|pipeline_config| &pipeline_config.name),
        "cases": cases,
        "passed": passed,
        "failed": failed,
        "exit": exit.code(),
    }))?;
    Ok(exit)
}
