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
use idem_host::{amqp, database, partition, pipeline, retention};
use sha2::Digest;

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
        /// After SIGTERM/SIGINT, how long in-flight messages may take to commit and ack before
        /// the process gives up (exit 1; the unacked messages are redelivered, nothing is lost).
        #[arg(long, default_value = "30s", env = "IDEM_SHUTDOWN_TIMEOUT", value_parser = idem_host::config::parse_duration)]
        shutdown_timeout: std::time::Duration,
    },
    /// Create or update the host's tables (processed_messages).
    Migrate {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Validate the config, compile every plugin, prepare every statement, and check RabbitMQ
    /// (credentials, vhost, every queue's existence and arguments); list every problem.
    Check {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
        /// Check the file and the plugins only; contact neither PostgreSQL nor RabbitMQ.
        #[arg(long)]
        offline: bool,
    },
    /// Delete claims older than each pipeline's retention window, in batches, once.
    Cleanup {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Convert processed_messages to daily partitions (keeps every claim; run before starting hosts).
    Partition {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Move dead-lettered messages back to their pipeline's queue (safe: claims dedup them).
    Replay {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
        #[arg(long, short)]
        pipeline: String,
        /// Move at most this many messages.
        #[arg(long)]
        limit: Option<u64>,
    },
    /// Pipelines, plugin builds, queue and dead-letter depths, claims.
    Status {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
    },
    /// Print the plugin contract this host was built with (the WIT package `idem:plugin`), or
    /// write it as a WIT package directory for a plugin project (`DIR/world.wit`).
    Wit {
        /// Write `world.wit` into this directory (created if missing) instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
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
        Command::Run {
            config,
            shutdown_timeout,
        } => {
            let config = Config::load(&config)?;
            let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel();
            let shutdown = async move {
                shutdown_signal().await;
                let _ = signalled_tx.send(());
            };
            let deadline = async move {
                if signalled_rx.await.is_err() {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(shutdown_timeout).await;
            };
            tokio::select! {
                ran = idem_host::run(config, shutdown) => {
                    ran?;
                    Ok(ExitCode::SUCCESS)
                }
                () = deadline => {
                    tracing::error!(timeout = ?shutdown_timeout, "Shutdown timed out; exiting with messages in flight. They were not acked and will be redelivered.");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Migrate { config } => {
            let config = Config::load(&config)?;
            let pool = database::connect_once(&config.database).await?;
            database::migrate(&pool, &config.database).await?;
            println!("migrations applied");
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { config, offline } => check(&config, offline).await,
        Command::Cleanup { config } => {
            let config = Config::load(&config)?;
            let pool = database::connect_once(&config.database).await?;
            database::record_consumers(&pool, &config.database, &config.pipelines).await?;
            let pipelines: Vec<_> = config
                .pipelines
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
            match retention::clean_all(&pool, &pipelines, None, &never).await? {
                retention::Pass::Cleaned(deleted) => {
                    for (consumer, count) in deleted {
                        println!("consumer {consumer:?}: {count} claims deleted");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                retention::Pass::Partitions(maintenance) => {
                    println!(
                        "partitions created {:?}, dropped {:?}",
                        maintenance.created, maintenance.dropped
                    );
                    Ok(ExitCode::SUCCESS)
                }
                retention::Pass::Busy => {
                    println!("another idem host is cleaning right now; nothing done");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Partition { config } => {
            let config = Config::load(&config)?;
            // One session, so the check for connected hosts can tell this one apart.
            let mut database_config = config.database.clone();
            database_config.max_connections = std::num::NonZeroU32::MIN;
            let pool = database::connect_once(&database_config).await?;
            database::record_consumers(&pool, &config.database, &config.pipelines).await?;
            let converted = match partition::convert(&pool).await? {
                partition::Conversion::HostsConnected { sessions } => {
                    eprintln!(
                        "idem partition: refused: {sessions} idem host session(s) are connected to this database; \
                         stop every host first (a running host would keep the unpartitioned claim form)"
                    );
                    return Ok(ExitCode::FAILURE);
                }
                partition::Conversion::Converted => true,
                partition::Conversion::AlreadyPartitioned => false,
            };
            let window = config
                .pipelines
                .iter()
                .map(|pipeline| pipeline.retention.window)
                .max()
                .unwrap_or_default();
            let maintenance = partition::maintain(&pool, window).await?;
            println!(
                "processed_messages {} partitioned by day; created {:?}, dropped {:?}",
                if converted { "is now" } else { "was already" },
                maintenance.created,
                maintenance.dropped
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Replay {
            config,
            pipeline,
            limit,
        } => {
            let config = Config::load(&config)?;
            let pipeline_config = config.pipeline(&pipeline).with_context(|| {
                format!("no pipeline {pipeline:?} in {}", config.path.display())
            })?;
            let moved = amqp::replay(&config.amqp, pipeline_config, limit).await?;
            println!(
                "replayed {moved} messages from {:?} to {:?}",
                pipeline_config.dead_letter_queue, pipeline_config.queue
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { config } => status(&config).await,
        Command::Try {
            config,
            pipeline,
            message,
        } => try_message(&config, &pipeline, &message).await,
        Command::Wit { out } => write_wit(out.as_deref()),
    }
}

fn write_wit(out: Option<&Path>) -> anyhow::Result<ExitCode> {
    let wit = idem_host::plugin::WORLD_WIT;
    let Some(directory) = out else {
        print!("{wit}");
        return Ok(ExitCode::SUCCESS);
    };
    std::fs::create_dir_all(directory)
        .with_context(|| format!("cannot create {}", directory.display()))?;
    let path = directory.join("world.wit");
    std::fs::write(&path, wit).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("idem wit: wrote {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// Collects every problem instead of stopping at the first.
async fn check(path: &Path, offline: bool) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let runtime = PluginRuntime::for_config(&config)?;
    let mut problems = Vec::new();
    if let Some(outbox) = &config.outbox
        && let Err(error) = idem_host::outbox::http_clients(outbox)
    {
        problems.push(error.to_string());
    }
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
    if offline {
        return Ok(verdict(
            &config,
            &problems,
            " (offline: PostgreSQL and RabbitMQ not checked)",
        ));
    }
    check_broker(&config, &mut problems).await;
    match database::connect_once(&config.database).await {
        Err(error) => problems.push(error.to_string()),
        Ok(pool) => {
            if let Err(error) =
                database::check_schema(&pool, &config.database, config.outbox.is_some()).await
            {
                problems.push(error.to_string());
            }
            for pipeline_config in &config.pipelines {
                match StatementCatalog::prepare(&pool, pipeline_config).await {
                    Ok(_) => println!(
                        "ok   pipeline {:?}: {} statements prepare",
                        pipeline_config.name,
                        pipeline_config.statements.len()
                    ),
                    Err(errors) => {
                        problems.extend(errors.0.iter().map(ToString::to_string));
                    }
                }
            }
        }
    }
    Ok(verdict(&config, &problems, ""))
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

/// Connects to RabbitMQ as `idem run` would and checks every pipeline's queues without
/// declaring any.
async fn check_broker(config: &Config, problems: &mut Vec<String>) {
    use amqp::topology::{self, Found, Role};
    let endpoint = idem_host::config::redact_url(&config.amqp.url);
    let connection = match amqp::connect(&config.amqp, "idem check".into()).await {
        Ok(connection) => connection,
        Err(error) => {
            problems.push(error.to_string());
            return;
        }
    };
    println!("ok   RabbitMQ at {endpoint}: credentials and vhost accepted");
    for pipeline_config in &config.pipelines {
        for role in [Role::Consumed, Role::DeadLetter] {
            let queue = role.queue(pipeline_config);
            let label = match role {
                Role::Consumed => "queue",
                Role::DeadLetter => "dead-letter queue",
            };
            let declared = topology::describe(pipeline_config, role);
            match topology::ensure(&connection, pipeline_config, role, false).await {
                Ok(Found::Exists { ready, .. }) => {
                    let how = if pipeline_config.declare {
                        format!("matches {declared}")
                    } else {
                        "used as your infrastructure declared it".to_string()
                    };
                    println!(
                        "ok   pipeline {:?}: {label} {queue:?} exists ({how}; {ready} ready)",
                        pipeline_config.name
                    );
                }
                Ok(Found::Missing | Found::Declared) => println!(
                    "ok   pipeline {:?}: {label} {queue:?} will be declared by idem run ({declared})",
                    pipeline_config.name
                ),
                Err(error) => problems.push(error.to_string()),
            }
        }
    }
    let _ = connection.close(200, "check done".into()).await;
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
            Ok(bytes) => format!("sha256:{:x}", sha2::Sha256::digest(&bytes)),
            Err(error) => format!("unreadable: {error}"),
        };
        println!(
            "  plugin file   {} ({plugin})",
            pipeline_config.plugin.display()
        );
        for (label, queue) in [
            ("queue", &pipeline_config.queue),
            ("dead letters", &pipeline_config.dead_letter_queue),
        ] {
            let depth = match amqp::queue_depth(&config.amqp, queue).await {
                Ok(Some(depth)) => format!("{} ready, {} consumers", depth.ready, depth.consumers),
                Ok(None) => "not declared yet".to_string(),
                Err(error) => format!("unknown ({error})"),
            };
            println!("  {label:<13} {queue:?}: {depth}");
        }
        if let Some(pool) = &pool {
            let claims: Result<(i64, Option<f64>), _> = sqlx::query_as(
                "SELECT count(*), extract(epoch FROM now() - min(processed_at))::float8 \
                 FROM processed_messages WHERE consumer = $1",
            )
            .bind(&pipeline_config.consumer)
            .fetch_one(pool)
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
        match idem_host::outbox::backlog(pool).await {
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
    let (report, code) = match outcome {
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
    match effect {
        Effect::Exec { statement, params } => {
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
        Effect::Outbox(message) => json!({ "outbox": {
            "destination": message.destination,
            "payload": String::from_utf8_lossy(&message.payload),
            "headers": message.headers,
            "key": message.key,
        } }),
    }
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
        // lapin logs every failed connection attempt as an error of its own; the host says
        // what failed and what it does about it (`RUST_LOG=lapin=debug` shows lapin's side).
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=off"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
