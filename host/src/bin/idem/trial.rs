//! `idem try` and `idem test`: a plugin's decisions without a broker, checked against the
//! pipeline's statements as `idem run` would check them.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use idem_host::cases::{self, Origin, Trial};
use idem_host::config::{Config, PipelineConfig, PluginLimits};
use idem_host::effect::Outcome;
use idem_host::pipeline;
use idem_host::sandbox::PluginRuntime;
use idem_host::source::rabbitmq;
use idem_host::store::database;
use idem_host::store::statement::StatementCatalog;

/// The delivery properties `idem try` sets from its flags.
pub struct Delivery {
    pub headers: Vec<String>,
    pub subject: Option<String>,
    pub message_id: Option<String>,
    pub redelivered: bool,
}

pub async fn try_message(
    path: &Path,
    pipeline_name: &str,
    message: &Path,
    delivery: Delivery,
    offline: bool,
) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let pipeline_config = pipeline_named(&config, pipeline_name)?;
    let body = if message == Path::new("-") {
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut body)
            .context("cannot read the message from stdin")?;
        body
    } else {
        std::fs::read(message).with_context(|| format!("cannot read message {message:?}"))?
    };
    let headers = delivery
        .headers
        .iter()
        .map(|header| {
            header
                .split_once('=')
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .with_context(|| format!("--header {header:?}: write it as NAME=VALUE"))
        })
        .collect::<anyhow::Result<_>>()?;
    let runtime = PluginRuntime::for_config(&config)?;
    let plugin = pipeline::load_plugin(&runtime, pipeline_config).await?;
    let subject = delivery
        .subject
        .unwrap_or_else(|| pipeline_config.queue().to_string());
    let mut inbound = Origin::of(pipeline_config).message(body, &subject);
    inbound.headers = headers;
    inbound.message_id = delivery.message_id;
    inbound.redelivered = delivery.redelivered;
    let started = std::time::Instant::now();
    let (outcome, stats) = runtime
        .invoke_measured(&plugin, &pipeline_config.limits, &inbound)
        .await;
    eprintln!(
        "idem try: {} ({}) called in {:.2} ms, {} KiB of linear memory",
        plugin.path.display(),
        plugin.digest,
        started.elapsed().as_secs_f64() * 1e3,
        stats.memory_bytes / 1024
    );
    println!(
        "{}",
        serde_json::to_string_pretty(&cases::outcome_json(&outcome))?
    );
    match &outcome {
        Ok(Outcome::Decision(decision)) => {
            let statements = statements(&config, pipeline_config, offline).await;
            match cases::fit(pipeline_config, &statements, decision) {
                Ok(()) => Ok(ExitCode::SUCCESS),
                Err(error) => {
                    eprintln!(
                        "idem try: this decision would be rejected by pipeline {:?}: {error}",
                        pipeline_config.name
                    );
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Ok(Outcome::Skip { .. }) => Ok(ExitCode::SUCCESS),
        Err(_) => Ok(ExitCode::FAILURE),
    }
}

/// Where `idem test` takes its plugin, limits and statements from.
pub struct TestTarget {
    pub plugin: Option<PathBuf>,
    pub config: Option<PathBuf>,
    pub pipeline: Option<String>,
    pub offline: bool,
}

pub async fn test(target: TestTarget, cases_path: &Path) -> anyhow::Result<ExitCode> {
    let cases = cases::load(cases_path)?;
    let (runtime, plugin, pipeline_config, statements) = match &target.config {
        Some(config_path) => {
            let config = Config::load(config_path)?;
            let pipeline_config = match &target.pipeline {
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
            let mut pipeline_config = pipeline_config;
            if let Some(plugin) = &target.plugin {
                pipeline_config.plugin = plugin.clone();
            }
            let runtime = PluginRuntime::for_config(&config)?;
            let plugin = pipeline::load_plugin(&runtime, &pipeline_config).await?;
            let statements = statements(&config, &pipeline_config, target.offline).await;
            (runtime, plugin, Some(pipeline_config), Some(statements))
        }
        None => {
            let path = target
                .plugin
                .clone()
                .context("name the plugin with --plugin X.wasm (or a pipeline with --config)")?;
            let runtime = PluginRuntime::new()?;
            let loading = runtime.clone();
            let plugin = tokio::task::spawn_blocking(move || loading.load(&path)).await??;
            (runtime, plugin, None, None)
        }
    };
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
                source: rabbitmq::KIND,
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

fn pipeline_named<'config>(
    config: &'config Config,
    name: &str,
) -> anyhow::Result<&'config PipelineConfig> {
    config.pipeline(name).with_context(|| {
        let known: Vec<&str> = config
            .pipelines
            .iter()
            .map(|pipeline| pipeline.name.as_str())
            .collect();
        format!(
            "no pipeline {name:?} in {} (it has: {})",
            config.path.display(),
            known.join(", ")
        )
    })
}

/// The pipeline's statements as PostgreSQL prepares them, or, when it is out of reach (or
/// `offline`), as the config declares them: names and parameter counts only.
async fn statements(
    config: &Config,
    pipeline_config: &PipelineConfig,
    offline: bool,
) -> StatementCatalog {
    if offline {
        return StatementCatalog::from_config(pipeline_config);
    }
    let pool = match database::connect_once(&config.database).await {
        Ok(pool) => pool,
        Err(error) => {
            eprintln!(
                "idem: PostgreSQL is out of reach ({error}); effects are checked for statement names and parameter counts, not types"
            );
            return StatementCatalog::from_config(pipeline_config);
        }
    };
    let prepared = StatementCatalog::prepare(&pool, pipeline_config).await;
    pool.close().await;
    prepared.unwrap_or_else(|errors| {
        eprintln!(
            "idem: pipeline {:?} has statements that do not prepare ({errors}); effects are checked for names and parameter counts only",
            pipeline_config.name
        );
        StatementCatalog::from_config(pipeline_config)
    })
}
