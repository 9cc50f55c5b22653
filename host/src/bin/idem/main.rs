//! The `idem` command line.

mod check;
mod dlq;
mod scaffold;
mod trial;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use idem_host::config::Config;
use idem_host::store::{database, partition, retention};

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
    /// Dead letters: list, show, and replay by error kind, reason or age.
    Dlq {
        #[command(subcommand)]
        command: DlqArgs,
    },
    /// Outbox rows not delivered: list them, send parked ones again.
    Outbox {
        #[command(subcommand)]
        command: OutboxArgs,
    },
    /// Move dead-lettered messages back to their pipeline's queue or stream, oldest first (safe: claims
    /// dedup them). `idem dlq replay` does the same by selection.
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
    /// Print the JSON Schema of pipelines.toml, for editors (e.g. taplo, Even Better TOML:
    /// `#:schema ./pipelines.schema.json` on the file's first line).
    Schema,
    /// Print a shell completion script: `idem completions bash > /etc/bash_completion.d/idem`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write a new plugin project in DIR (named after it): the handler, the guest helper, the
    /// WIT, pinned build files, cases.json, a pipeline fragment and a README.
    New {
        #[arg(value_enum)]
        language: scaffold::Language,
        directory: PathBuf,
    },
    /// Build the plugin project in DIR into DIR/<name>.wasm with its language's toolchain.
    Build {
        #[arg(default_value = ".")]
        directory: PathBuf,
    },
    /// Run a pipeline's plugin on one message and print its decision (no broker); its effects
    /// are checked against the pipeline's statements (types too when PostgreSQL is reachable).
    Try {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
        /// The pipeline whose plugin and limits to use.
        #[arg(long, short)]
        pipeline: String,
        /// A file holding the message body (`-` reads stdin).
        #[arg(long, short)]
        message: PathBuf,
        /// A message header, NAME=VALUE (repeatable).
        #[arg(long = "header", value_name = "NAME=VALUE")]
        headers: Vec<String>,
        /// The subject, or RabbitMQ's routing key (default: the pipeline's queue).
        #[arg(long, visible_alias = "routing-key")]
        subject: Option<String>,
        /// The message-id property.
        #[arg(long)]
        message_id: Option<String>,
        /// Mark the delivery as redelivered.
        #[arg(long)]
        redelivered: bool,
        /// Check effects against the config's statements without contacting PostgreSQL.
        #[arg(long)]
        offline: bool,
    },
    /// Run a plugin on every case of a case file and show each difference from the expected
    /// outcome (exit 1 on any); with --config, also check every effect against the pipeline.
    Test {
        /// The plugin (default: the pipeline's, with --config).
        #[arg(long)]
        plugin: Option<PathBuf>,
        /// The case file (JSON: messages and expected outcomes).
        #[arg(long, default_value = "cases.json")]
        cases: PathBuf,
        /// A pipelines file whose pipeline's limits and statements to test against.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// The pipeline in --config (needed when it has several).
        #[arg(long, short)]
        pipeline: Option<String>,
        /// Check effects against the config's statements without contacting PostgreSQL.
        #[arg(long)]
        offline: bool,
    },
}

/// The pipeline whose dead-letter queue a `dlq` command reads.
#[derive(clap::Args)]
struct DlqTarget {
    #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
    config: PathBuf,
    #[arg(long, short)]
    pipeline: String,
}

/// Which dead letters a `dlq` command acts on; all given filters must match.
#[derive(clap::Args)]
struct DlqFilter {
    /// The error kind, e.g. invalid-input, plugin-trap, retries-exhausted, sql.
    #[arg(long)]
    kind: Option<String>,
    /// A fragment of the reason.
    #[arg(long)]
    reason: Option<String>,
    /// Dead-lettered at most this long ago, e.g. 30m or 2h.
    #[arg(long, value_parser = idem_host::config::parse_duration)]
    since: Option<std::time::Duration>,
    /// At most this many messages.
    #[arg(long)]
    limit: Option<u64>,
}

impl DlqFilter {
    fn selection(self) -> idem_host::source::dead_letters::Selection {
        idem_host::source::dead_letters::Selection {
            kind: self.kind,
            reason: self.reason,
            since: self.since,
            ids: None,
            limit: self.limit,
        }
    }
}

#[derive(Subcommand)]
enum DlqArgs {
    /// List dead letters, oldest first: number, age, error kind, reason, body preview. Every
    /// message is looked at and returned in its order; nothing is consumed.
    List {
        #[command(flatten)]
        target: DlqTarget,
        #[command(flatten)]
        filter: DlqFilter,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter in full: headers, properties and body.
    Show {
        #[command(flatten)]
        target: DlqTarget,
        /// Its number in `idem dlq list`.
        number: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Move the matching dead letters to the pipeline's queue (original headers kept, plus
    /// x-idem-replays); the others stay where they are.
    Replay {
        #[command(flatten)]
        target: DlqTarget,
        #[command(flatten)]
        filter: DlqFilter,
        /// Show what would move; move nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Subcommand)]
enum OutboxArgs {
    /// Undelivered outbox rows, oldest first (pending and parked).
    List {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
        /// Only rows parked after their last attempt.
        #[arg(long)]
        parked: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make parked rows pending again (all, one destination's, or one row); the relay of a
    /// running `idem run` delivers them.
    Retry {
        #[arg(long, short, default_value = "pipelines.toml", env = "IDEM_CONFIG")]
        config: PathBuf,
        #[arg(long)]
        destination: Option<String>,
        #[arg(long)]
        id: Option<i64>,
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
        Command::Check { config, offline } => check::check(&config, offline).await,
        Command::Cleanup { config } => {
            let config = Config::load(&config)?;
            let pool = database::connect_once(&config.database).await?;
            retention::record_consumers(&pool, &config.database, &config.pipelines).await?;
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
            retention::record_consumers(&pool, &config.database, &config.pipelines).await?;
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
            let selection = idem_host::source::dead_letters::Selection {
                limit,
                ..Default::default()
            };
            let replay = dlq::DlqCommand::Replay { dry_run: false };
            dlq::dlq(&config, &pipeline, selection, replay).await
        }
        Command::Status { config } => check::status(&config).await,
        Command::Dlq { command } => {
            let (target, selection, command) = match command {
                DlqArgs::List {
                    target,
                    filter,
                    json,
                } => (target, filter.selection(), dlq::DlqCommand::List { json }),
                DlqArgs::Show {
                    target,
                    number,
                    json,
                } => (
                    target,
                    Default::default(),
                    dlq::DlqCommand::Show {
                        position: number,
                        json,
                    },
                ),
                DlqArgs::Replay {
                    target,
                    filter,
                    dry_run,
                } => (
                    target,
                    filter.selection(),
                    dlq::DlqCommand::Replay { dry_run },
                ),
            };
            dlq::dlq(&target.config, &target.pipeline, selection, command).await
        }
        Command::Outbox { command } => match command {
            OutboxArgs::List {
                config,
                parked,
                json,
            } => dlq::outbox(&config, dlq::OutboxCommand::List { parked, json }).await,
            OutboxArgs::Retry {
                config,
                destination,
                id,
            } => dlq::outbox(&config, dlq::OutboxCommand::Retry { destination, id }).await,
        },
        Command::Try {
            config,
            pipeline,
            message,
            headers,
            subject,
            message_id,
            redelivered,
            offline,
        } => {
            let delivery = trial::Delivery {
                headers,
                subject,
                message_id,
                redelivered,
            };
            trial::try_message(&config, &pipeline, &message, delivery, offline).await
        }
        Command::Test {
            plugin,
            cases,
            config,
            pipeline,
            offline,
        } => {
            let target = trial::TestTarget {
                plugin,
                config,
                pipeline,
                offline,
            };
            trial::test(target, &cases).await
        }
        Command::Wit { out } => write_wit(out.as_deref()),
        Command::New {
            language,
            directory,
        } => scaffold::new(language, &directory),
        Command::Build { directory } => scaffold::build(&directory),
        Command::Schema => {
            let schema = idem_host::config::json_schema();
            println!("{}", serde_json::to_string_pretty(&schema)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut command, "idem", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn write_wit(out: Option<&Path>) -> anyhow::Result<ExitCode> {
    let wit = idem_host::sandbox::WORLD_WIT;
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
