//! `idem outbox`: outbox rows not delivered, listed, and parked ones sent again.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use idem_host::config::Config;
use idem_host::source::dead_letters::cut_line;
use idem_host::store::{database, outbox};

use crate::ConfigArg;
use crate::table::{format_age, print_table};

/// Outbox rows not delivered: list them, send parked ones again.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: OutboxArgs,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        match self.command {
            OutboxArgs::List {
                config,
                parked,
                json,
            } => outbox(&config.config, OutboxCommand::List { parked, json }).await,
            OutboxArgs::Retry {
                config,
                destination,
                id,
            } => outbox(&config.config, OutboxCommand::Retry { destination, id }).await,
        }
    }
}

#[derive(clap::Subcommand)]
enum OutboxArgs {
    /// Undelivered outbox rows, oldest first (pending and parked).
    List {
        #[command(flatten)]
        config: ConfigArg,
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
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        destination: Option<String>,
        #[arg(long)]
        id: Option<i64>,
    },
}

enum OutboxCommand {
    List {
        parked: bool,
        json: bool,
    },
    Retry {
        destination: Option<String>,
        id: Option<i64>,
    },
}

async fn outbox(path: &Path, command: OutboxCommand) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let pool = database::connect_once(&config.database).await?;
    match command {
        OutboxCommand::List { parked, json } => {
            let rows = outbox::undelivered(&pool, parked, 1000).await?;
            if json {
                let rows: Vec<_> = rows.iter().map(outbox::Undelivered::json).collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(ExitCode::SUCCESS);
            }
            let count = rows.len();
            let table = rows
                .into_iter()
                .map(|row| {
                    [
                        row.id.to_string(),
                        if row.parked { "parked" } else { "pending" }.to_string(),
                        row.destination,
                        row.idempotency_key,
                        row.attempts.to_string(),
                        format_age(Duration::from_secs_f64(row.age_seconds.max(0.0))),
                        cut_line(row.last_error.as_deref().unwrap_or("-"), 80),
                    ]
                })
                .collect();
            print_table(
                &[
                    "ID",
                    "STATE",
                    "DESTINATION",
                    "KEY",
                    "ATTEMPTS",
                    "AGE",
                    "LAST ERROR",
                ],
                table,
            );
            eprintln!(
                "{count} {} outbox row(s){}",
                if parked { "parked" } else { "undelivered" },
                if count == 1000 {
                    " (the oldest 1000)"
                } else {
                    ""
                }
            );
            Ok(ExitCode::SUCCESS)
        }
        OutboxCommand::Retry { destination, id } => {
            let ids = outbox::retry_parked(&pool, destination.as_deref(), id).await?;
            if ids.is_empty() {
                println!("no parked outbox row matched; nothing to retry");
                return Ok(ExitCode::FAILURE);
            }
            println!(
                "{} parked row(s) are pending again ({}); a running `idem run` delivers them on its relay's next pass",
                ids.len(),
                ids.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
