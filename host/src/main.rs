//! The `idem` command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::json;

use idem_host::config::Config;
use idem_host::effect::{Effect, Outcome, Value};
use idem_host::message::InboundMessage;
use idem_host::plugin::{PluginError, PluginRuntime};
use idem_host::statement::StatementCatalog;
use idem_host::{database, pipeline};

/// Exactly-once database effects from at-least-once message delivery.
#[derive(Parser)]
#[command(name = "idem", version)]
struct Cli {
    /// Log format on stderr.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "IDEM_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Consume every pipeline's queue until SIGTERM or Ctrl-C.
    Run {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Create or update the host's tables (processed_messages).
    Migrate {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Validate the config, compile every plugin and prepare every statement; list every problem.
    Check {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Run a pipeline's plugin on one message file and print its decision (no broker, no database).
    Try {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
        /// The pipeline whose plugin and limits to use.
        #[arg(long, short)]
        pipeline: String,
        /// A file holding the message body.
        #[arg(long, short)]
        message: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idem: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("idem: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run { config } => {
            let config = Config::load(&config)?;
            idem_host::run(config, shutdown_signal()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate { config } => {
            let config = Config::load(&config)?;
            let pool = database::connect_once(&config.database).await?;
            database::migrate(&pool, &config.database).await?;
            println!("migrations applied");
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { config } => check(&config).await,
        Command::Try {
            config,
            pipeline,
            message,
        } => try_message(&config, &pipeline, &message).await,
    }
}

/// Collects every problem instead of stopping at the first.
async fn check(path: &Path) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let runtime = PluginRuntime::new()?;
    let mut problems = Vec::new();
    for pipeline_config in &config.pipelines {
        match pipeline::load_plugin(&runtime, pipeline_config).await {
            Ok(plugin) => println!(
                "ok   pipeline {:?}: plugin {} ({})",
                pipeline_config.name,
                plugin.path.display(),
                plugin.digest
            ),
            Err(error) => problems.push(error.to_string()),
        }
    }
    match database::connect_once(&config.database).await {
        Err(error) => problems.push(error.to_string()),
        Ok(pool) => {
            if let Err(error) = database::check_schema(&pool, &config.database).await {
                problems.push(error.to_string());
            }
            for pipeline_config in &config.pipelines {
                match StatementCatalog::prepare(&pool, pipeline_config).await {
                    Ok(_) => println!(
                        "ok   pipeline {:?}: {} statements prepare",
                        pipeline_config.name,
                        pipeline_config.statements.len()
                    ),
                    Err(error) => problems.push(error.to_string()),
                }
            }
        }
    }
    for problem in &problems {
        println!("FAIL {problem}");
    }
    if problems.is_empty() {
        println!("{} is ready to run", config.path.display());
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{} problem(s) found", problems.len());
        Ok(ExitCode::FAILURE)
    }
}

async fn try_message(path: &Path, pipeline_name: &str, message: &Path) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let pipeline_config = config
        .pipeline(pipeline_name)
        .with_context(|| format!("no pipeline {pipeline_name:?} in {}", config.path.display()))?;
    let body =
        std::fs::read(message).with_context(|| format!("cannot read message {message:?}"))?;
    let runtime = PluginRuntime::new()?;
    let plugin = pipeline::load_plugin(&runtime, pipeline_config).await?;
    let inbound = InboundMessage {
        pipeline: pipeline_config.name.clone(),
        body,
        routing_key: pipeline_config.queue.clone(),
        ..InboundMessage::default()
    };
    let (report, code) = match runtime
        .invoke(&plugin, &pipeline_config.limits, &inbound)
        .await
    {
        Ok(Outcome::Decision(decision)) => (
            json!({
                "outcome": "decision",
                "key": decision.key,
                "effects": decision.effects.iter().map(effect_json).collect::<Vec<_>>(),
            }),
            ExitCode::SUCCESS,
        ),
        Ok(Outcome::Skip { reason }) => (
            json!({ "outcome": "skip", "reason": reason }),
            ExitCode::SUCCESS,
        ),
        Err(PluginError::Rejected(failure)) => (
            json!({ "outcome": "failure", "kind": failure.kind.as_str(), "reason": failure.reason }),
            ExitCode::FAILURE,
        ),
        Err(error) => (
            json!({ "outcome": "error", "reason": error.to_string() }),
            ExitCode::FAILURE,
        ),
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(code)
}

fn effect_json(effect: &Effect) -> serde_json::Value {
    let Effect::Exec { statement, params } = effect;
    let params: Vec<serde_json::Value> = params
        .iter()
        .map(|value| match value {
            Value::Null => json!({ "null": null }),
            Value::Boolean(flag) => json!({ "boolean": flag }),
            Value::Integer(integer) => json!({ "integer": integer }),
            Value::Float(float) => json!({ "float": float }),
            Value::Text(text) => json!({ "text": text }),
            Value::Json(text) => json!({ "json": text }),
            Value::Bytes(bytes) => json!({ "bytes": bytes }),
            Value::Timestamp(micros) => json!({ "timestamp": micros }),
        })
        .collect();
    json!({ "exec": { "statement": statement, "params": params } })
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
