//! `idem outbox`: outbox rows not delivered, listed, and parked ones sent again.

use std::path::Path;
use std::time::Duration;

use idem_host::config::Config;
use idem_host::source::dead_letters::cut_line;
use idem_host::store::tables::Tables;
use idem_host::store::{database, outbox};

use crate::exit::{Exit, UsageError};
use crate::lookup::ConfigArg;
use crate::output::{FormatArg, print_json};
use crate::table::{format_age, print_table};

/// Outbox rows not delivered: list them, send parked ones again.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: OutboxArgs,
}

impl Args {
    /// The report's format.
    pub fn format(&self) -> Option<FormatArg> {
        match &self.command {
            OutboxArgs::List { format, .. } | OutboxArgs::Retry { format, .. } => Some(*format),
        }
    }

    pub async fn run(self) -> anyhow::Result<Exit> {
        match self.command {
            OutboxArgs::List {
                config,
                parked,
                format,
                database,
            } => {
                let command = OutboxCommand::List {
                    parked,
                    json: format.is_json(),
                };
                outbox(&config.config, database, command).await
            }
            OutboxArgs::Retry {
                config,
                destination,
                id,
                database,
                format,
            } => {
                let command = OutboxCommand::Retry {
                    destination,
                    id,
                    json: format.is_json(),
                };
                outbox(&config.config, database, command).await
            }
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
        #[command(flatten)]
        format: FormatArg,
        /// Only the rows of `[databases.<name>]` (default: every database's).
        #[arg(long)]
        database: Option<String>,
    },
    /// Make parked rows pending again (all, one destination's, or one row); the relay of a
    /// running `idem run` delivers them.
    Retry {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        destination: Option<String>,
        /// Only row `id` (ids are per database: of `[database]`, unless `--database`).
        #[arg(long)]
        id: Option<i64>,
        /// Only the rows of `[databases.<name>]` (default: every database's, or
        /// `[database]`'s with `--id`).
        #[arg(long)]
        database: Option<String>,
        #[command(flatten)]
        format: FormatArg,
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
        json: bool,
    },
}

async fn outbox(
    path: &Path,
    database: Option<String>,
    command: OutboxCommand,
) -> anyhow::Result<Exit> {
    let config = Config::load(path)?;
    if let Some(name) = &database
        && !config.databases.contains_key(name)
    {
        return Err(UsageError(format!(
            "--database {name:?}: no [databases.{name}] table in the config"
        ))
        .into());
    }
    let several = !config.databases.is_empty();
    let retry_one = matches!(command, OutboxCommand::Retry { id: Some(_), .. });
    let mut chosen = Vec::new();
    for (name, database_config) in config.all_databases() {
        let wanted = match &database {
            Some(wanted) => name == Some(wanted.as_str()),
            None => !retry_one || name.is_none(),
        };
        if wanted {
            let pool = database::connect_once(database_config).await?;
            chosen.push((name, pool, Tables::of(database_config)));
        }
    }
    match command {
        OutboxCommand::List { parked, json } => {
            let mut rows = Vec::new();
            for (name, pool, tables) in &chosen {
                for row in outbox::undelivered(pool, tables, parked, 1000).await? {
                    rows.push((*name, row));
                }
            }
            if json {
                let rows: Vec<_> = rows
                    .iter()
                    .map(|(name, row)| {
                        let mut json = row.json();
                        json["database"] = serde_json::json!(name);
                        json
                    })
                    .collect();
                print_json(&serde_json::Value::from(rows))?;
            } else {
                list(rows, parked, several);
            }
            Ok(Exit::Success)
        }
        OutboxCommand::Retry {
            destination,
            id,
            json,
        } => {
            let mut ids = Vec::new();
            for (name, pool, tables) in &chosen {
                for retried in
                    outbox::retry_parked(pool, tables, destination.as_deref(), id).await?
                {
                    ids.push(match name {
                        Some(name) if several => format!("{name}:{retried}"),
                        _ => retried.to_string(),
                    });
                }
            }
            retried(&ids, json)
        }
    }
}

/// Says which parked rows are pending again; `Findings` when none matched.
fn retried(ids: &[String], json: bool) -> anyhow::Result<Exit> {
    let exit = if ids.is_empty() {
        Exit::Findings
    } else {
        Exit::Success
    };
    if json {
        print_json(&serde_json::json!({ "retried": ids, "exit": exit.code() }))?;
    } else if ids.is_empty() {
        println!("no parked outbox row matched; nothing to retry");
    } else {
        println!(
            "{} parked row(s) are pending again ({}); a running `idem run` delivers them on its relay's next pass",
            ids.len(),
            ids.join(", ")
        );
    }
    Ok(exit)
}

/// Prints undelivered rows as a table, with each row's database when there are several.
fn list(rows: Vec<(Option<&str>, outbox::Undelivered)>, parked: bool, several: bool) {
    let count = rows.len();
    let table = rows
        .into_iter()
        .map(|(name, row)| {
            [
                match name {
                    Some(name) if several => format!("{name}:{}", row.id),
                    _ => row.id.to_string(),
                },
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
        if count >= 1000 {
            " (the oldest 1000 of each database)"
        } else {
            ""
        }
    );
}
