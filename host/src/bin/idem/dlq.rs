//! `idem dlq` and `idem outbox`: what failed and was kept aside, looked at and sent again.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

use idem_host::config::{Config, PipelineConfig};
use idem_host::source::dead_letters::{self, Action, PREVIEW_CHARS, Selection, cut_line};
use idem_host::store::{database, outbox};

pub enum DlqCommand {
    List { json: bool },
    Show { position: u64, json: bool },
    Replay { dry_run: bool },
}

pub async fn dlq(
    path: &Path,
    pipeline_name: &str,
    selection: Selection,
    command: DlqCommand,
) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let pipeline = config
        .pipeline(pipeline_name)
        .with_context(|| format!("no pipeline {pipeline_name:?} in {}", config.path.display()))?;
    match command {
        DlqCommand::List { json } => list(&config, pipeline, &selection, json).await,
        DlqCommand::Show { position, json } => show(&config, pipeline, position, json).await,
        DlqCommand::Replay { dry_run } => replay(&config, pipeline, &selection, dry_run).await,
    }
}

async fn list(
    config: &Config,
    pipeline: &PipelineConfig,
    selection: &Selection,
    as_json: bool,
) -> anyhow::Result<ExitCode> {
    let mut rows = Vec::new();
    let mut letters = Vec::new();
    dead_letters::pass(
        config.amqp.as_ref(),
        pipeline,
        selection,
        Action::Look,
        |letter| {
            if as_json {
                letters.push(letter.json(false));
            } else {
                rows.push([
                    letter.position.to_string(),
                    letter.age.map_or("-".into(), format_age),
                    letter.kind.clone().unwrap_or_else(|| "-".into()),
                    cut_line(letter.reason.as_deref().unwrap_or("-"), 80),
                    cut_line(
                        &String::from_utf8_lossy(&letter.message.body),
                        PREVIEW_CHARS,
                    ),
                ]);
            }
        },
    )
    .await?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&letters)?);
        return Ok(ExitCode::SUCCESS);
    }
    let count = rows.len();
    print_table(&["#", "AGE", "KIND", "REASON", "BODY"], rows);
    eprintln!(
        "{count} dead letter(s) in {:?} match; nothing was moved",
        pipeline.dead_letter()
    );
    Ok(ExitCode::SUCCESS)
}

async fn show(
    config: &Config,
    pipeline: &PipelineConfig,
    position: u64,
    as_json: bool,
) -> anyhow::Result<ExitCode> {
    let mut found = None;
    // The messages up to the one asked for: the rest of the queue is not taken.
    let everything = Selection {
        limit: Some(position),
        ..Selection::default()
    };
    dead_letters::pass(
        config.amqp.as_ref(),
        pipeline,
        &everything,
        Action::Look,
        |letter| {
            if letter.position == position {
                found = Some(letter.clone());
            }
        },
    )
    .await?;
    let Some(letter) = found else {
        eprintln!(
            "idem dlq show: {:?} holds no message #{position} (`idem dlq list` numbers them from 1, oldest first)",
            pipeline.dead_letter()
        );
        return Ok(ExitCode::FAILURE);
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&letter.json(true))?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("#{} in {:?}", letter.position, pipeline.dead_letter());
    println!("kind         {}", letter.kind.as_deref().unwrap_or("-"));
    println!("reason       {}", letter.reason.as_deref().unwrap_or("-"));
    println!("age          {}", letter.age.map_or("-".into(), format_age));
    println!("replays      {}", letter.replays);
    println!(
        "message-id   {}",
        letter.message.message_id.as_deref().unwrap_or("-")
    );
    println!("subject      {}", letter.message.subject);
    println!("headers");
    for (name, value) in &letter.message.headers {
        println!("  {name}: {value}");
    }
    match std::str::from_utf8(&letter.message.body) {
        Ok(text) => println!("body ({} bytes)\n{text}", letter.message.body.len()),
        Err(_) => println!(
            "body ({} bytes, not UTF-8, hex)\n{}",
            letter.message.body.len(),
            hex::encode(&letter.message.body)
        ),
    }
    Ok(ExitCode::SUCCESS)
}

async fn replay(
    config: &Config,
    pipeline: &PipelineConfig,
    selection: &Selection,
    dry_run: bool,
) -> anyhow::Result<ExitCode> {
    let action = if dry_run {
        Action::Look
    } else {
        Action::Replay
    };
    let verb = if dry_run { "would replay" } else { "replayed" };
    let moved = dead_letters::pass(
        config.amqp.as_ref(),
        pipeline,
        selection,
        action,
        |letter| {
            println!(
                "{verb} #{} ({}: {})",
                letter.position,
                letter.kind.as_deref().unwrap_or("-"),
                cut_line(letter.reason.as_deref().unwrap_or("-"), 80)
            );
        },
    )
    .await?;
    println!(
        "{verb} {moved} message(s) from {:?} to {:?}{}",
        pipeline.dead_letter(),
        pipeline.queue(),
        if dry_run {
            " (dry run: nothing moved)"
        } else {
            ""
        }
    );
    Ok(ExitCode::SUCCESS)
}

pub enum OutboxCommand {
    List {
        parked: bool,
        json: bool,
    },
    Retry {
        destination: Option<String>,
        id: Option<i64>,
    },
}

pub async fn outbox(path: &Path, command: OutboxCommand) -> anyhow::Result<ExitCode> {
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

fn print_table<const N: usize>(header: &[&str; N], rows: Vec<[String; N]>) {
    let mut widths = header.map(|title| title.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut text = String::new();
        for (index, (cell, width)) in cells.iter().zip(widths).enumerate() {
            if index + 1 == N {
                text.push_str(cell);
            } else {
                text.push_str(&format!("{cell:<width$}  "));
            }
        }
        println!("{}", text.trim_end());
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
}

fn format_age(age: Duration) -> String {
    let seconds = age.as_secs();
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86400 => format!("{}h{:02}m", seconds / 3600, seconds % 3600 / 60),
        _ => format!("{}d{:02}h", seconds / 86400, seconds % 86400 / 3600),
    }
}
