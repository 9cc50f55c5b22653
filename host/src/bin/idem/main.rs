//! The `idem` command line.

//!
//! One file per command, each with its `Args` and their `run`; `dispatch` is one line per
//! command. `kit` (the plugin languages: project files and builds), `table` (plain-text tables) and
//! `trial`'s pipeline and statement lookups serve several commands.

mod build;
mod check;
mod cleanup;
mod completions;
mod dlq;
mod exit;
mod kit;
mod lookup;
mod migrate;
mod new;
mod outbox;
mod output;
mod partition;
mod pause;
mod reference;
mod replay;
mod run;
mod schema;
mod status;
mod table;
mod test;
mod trial;
mod wit;

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use exit::Exit;
use idem_host::telemetry::export::TraceExport;

/// The version `idem --version` prints, with the plugin contracts this host runs (kept to
/// `sandbox::contract::SPOKEN` by a test).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (plugin contracts: idem:plugin@0.3.0, idem:plugin@0.2.0 deprecated)"
);

/// Exactly-once database effects from at-least-once message delivery.
#[derive(Parser)]
#[command(name = "idem", version = VERSION)]
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

/// One variant per command, each with the arguments of its own file.
#[derive(Subcommand)]
enum Command {
    Run(run::Args),
    Migrate(migrate::Args),
    Check(check::Args),
    Cleanup(cleanup::Args),
    Partition(partition::Args),
    Dlq(dlq::Args),
    Outbox(outbox::Args),
    Replay(replay::Args),
    Pause(pause::PauseArgs),
    Resume(pause::ResumeArgs),
    Status(status::Args),
    Wit(wit::Args),
    Schema(schema::Args),
    Reference(reference::Args),
    Completions(completions::Args),
    New(new::Args),
    Build(build::Args),
    Try(trial::Args),
    Test(test::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idem: cannot start the async runtime: {error}");
            return Exit::Failure.into();
        }
    };
    let log_format = cli.log_format;
    let json = cli.command.reports_json();
    let ran = match cli.command {
        // `idem run` exports traces when its file or the OTEL_* variables say so.
        Command::Run(args) => args.main(&runtime, |traces| {
            init_tracing(log_format, "info", traces);
        }),
        command => {
            init_tracing(log_format, command.log_level(), None);
            runtime.block_on(dispatch(command))
        }
    };
    let exit = match ran {
        Ok(exit) => exit,
        Err(error) => {
            let exit = Exit::of_error(&error);
            eprintln!("idem: {}", one_line(&error));
            // A script that asked for JSON reads it from stdout, error or not.
            if json {
                let report = serde_json::json!({ "error": one_line(&error), "exit": exit.code() });
                println!("{report}");
            }
            exit
        }
    };
    exit.into()
}

/// `error` and its causes on one line, each cause once: most of the host's errors already
/// say their cause in their own message, which `{:#}` would print again.
fn one_line(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

impl Command {
    /// The least a command logs unless `RUST_LOG` says otherwise: a report (`idem check`,
    /// `idem status`) prints only itself, so the clients' own progress lines (the NATS
    /// client's "connected" at info) stay out of it; problems still show.
    fn log_level(&self) -> &'static str {
        match self {
            Command::Check(_) | Command::Status(_) => "warn",
            _ => "info",
        }
    }

    /// Whether the command was asked for a JSON report (`--format json`): an error is then
    /// a JSON document on stdout too.
    fn reports_json(&self) -> bool {
        let format = match self {
            Command::Check(args) => Some(args.format),
            Command::Status(args) => Some(args.format),
            Command::Test(args) => Some(args.format),
            Command::Replay(args) => Some(args.format),
            Command::Outbox(args) => args.format(),
            Command::Dlq(args) => args.format(),
            _ => None,
        };
        format.is_some_and(output::FormatArg::is_json)
    }
}

async fn dispatch(command: Command) -> anyhow::Result<Exit> {
    match command {
        Command::Run(_) => unreachable!("`idem run` starts in main, with its trace export"),
        Command::Migrate(args) => args.run().await,
        Command::Check(args) => args.run().await,
        Command::Cleanup(args) => args.run().await,
        Command::Partition(args) => args.run().await,
        Command::Dlq(args) => args.run().await,
        Command::Outbox(args) => args.run().await,
        Command::Replay(args) => args.run().await,
        Command::Pause(args) => args.run().await,
        Command::Resume(args) => args.run().await,
        Command::Status(args) => args.run().await,
        Command::Wit(args) => args.run(),
        Command::Schema(args) => args.run(),
        Command::Reference(args) => args.run(),
        Command::Completions(args) => args.run(),
        Command::New(args) => args.run(),
        Command::Build(args) => args.run(),
        Command::Try(args) => args.run().await,
        Command::Test(args) => args.run().await,
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (else `level`); with `traces`, the host's spans
/// are exported too, whatever `RUST_LOG` says.
fn init_tracing(format: LogFormat, level: &str, traces: Option<&TraceExport>) {
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // lapin logs every failed connection attempt as an error of its own; the host says
        // what failed and what it does about it (`RUST_LOG=lapin=debug` shows lapin's side).
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{level},lapin=off")));
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(idem_host::telemetry::logs::FlatJson)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(traces.map(TraceExport::layer))
        .with(logs.with_filter(filter))
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cause the message already says is printed once; one it does not say is added.
    #[test]
    fn an_error_prints_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("plugin \"x.wasm\": {source}")]
        struct Said {
            source: std::io::Error,
        }
        let said = anyhow::Error::new(Said {
            source: std::io::Error::other("no such file"),
        });
        assert_eq!(one_line(&said), "plugin \"x.wasm\": no such file");
        let added = anyhow::Error::new(std::io::Error::other("refused")).context("traces");
        assert_eq!(one_line(&added), "traces: refused");
    }

    /// `idem --version` names every contract the host runs, and no other, and which are
    /// deprecated.
    #[test]
    fn the_version_names_the_contracts_the_host_runs() {
        let spoken: Vec<String> = idem_host::sandbox::contract::SPOKEN
            .iter()
            .map(|version| {
                let deprecated = idem_host::sandbox::contract::is_deprecated(version);
                format!(
                    "idem:plugin@{version}{}",
                    if deprecated { " deprecated" } else { "" }
                )
            })
            .collect();
        assert_eq!(
            VERSION,
            format!(
                "{} (plugin contracts: {})",
                env!("CARGO_PKG_VERSION"),
                spoken.join(", ")
            )
        );
    }
}
