//! `idem status`: how each pipeline is doing: its plugin build, what its source holds, its
//! dead letters and claims. Exits `Unavailable` when a database or broker is out of reach
//! (`Config` when one refused a setting), so a probe can tell.

use std::path::Path;

use serde_json::{Value, json};

use idem_host::config::{Config, PipelineConfig};
use idem_host::sandbox::contract;
use idem_host::source::{self, StatusLine};
use idem_host::store::tables::Tables;
use idem_host::store::{database, outbox, retention};
use sqlx::PgPool;

use crate::exit::Exit;
use crate::lookup::ConfigArg;
use crate::output::{FormatArg, print_json};

/// Pipelines, plugin builds, queue and dead-letter depths, claims; exits 4 when a database
/// or broker is out of reach.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    #[command(flatten)]
    pub format: FormatArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        let report = status(&config).await;
        if self.format.is_json() {
            print_json(&report.json)?;
        } else {
            for line in &report.text {
                println!("{line}");
            }
        }
        Ok(report.exit)
    }
}

/// The report in both forms, and the exit it makes.
struct Report {
    text: Vec<String>,
    json: Value,
    exit: Exit,
}

/// A database of the config, opened if it could be, with where idem's tables are in it.
struct Opened<'config> {
    name: Option<&'config str>,
    pool: Option<PgPool>,
    tables: Tables,
}

async fn status(config: &Config) -> Report {
    let mut exit = Exit::Success;
    let mut databases = Vec::new();
    for (name, database_config) in config.all_databases() {
        let pool = database::connect_once(database_config).await.ok();
        if pool.is_none() {
            exit = exit.worst(Exit::Unavailable);
        }
        databases.push(Opened {
            name,
            pool,
            tables: Tables::of(database_config),
        });
    }
    let mut text = Vec::new();
    let mut pipelines = Vec::new();
    for pipeline_config in &config.pipelines {
        let opened = databases
            .iter()
            .find(|opened| opened.name == pipeline_config.database.as_deref())
            .expect("the config names only databases it has");
        let (lines, json, source_exit) = pipeline_status(pipeline_config, opened).await;
        text.extend(lines);
        pipelines.push(json);
        exit = exit.worst(source_exit);
    }
    let several = databases.len() > 1;
    let mut database_reports = Vec::new();
    for opened in &databases {
        let (line, json) = database_status(config, opened, several).await;
        text.extend(line);
        database_reports.push(json);
    }
    Report {
        text,
        json: json!({
            "config": config.path.display().to_string(),
            "pipelines": pipelines,
            "databases": database_reports,
            "exit": exit.code(),
        }),
        exit,
    }
}

/// One pipeline's lines, its JSON, and the exit its source makes.
async fn pipeline_status(
    pipeline_config: &PipelineConfig,
    opened: &Opened<'_>,
) -> (Vec<String>, Value, Exit) {
    let mut text = vec![format!(
        "pipeline {:?} (consumer {:?})",
        pipeline_config.name, pipeline_config.consumer
    )];
    if let Some(name) = &pipeline_config.database {
        text.push(format!("  database      {}", database::label(Some(name))));
    }
    let build = plugin_build(&pipeline_config.plugin);
    text.push(format!(
        "  plugin file   {} ({build})",
        pipeline_config.plugin.display()
    ));
    let mut exit = Exit::Success;
    let mut sources = Vec::new();
    for line in source::status(pipeline_config).await {
        text.push(format!(
            "  {:<13} {:?}: {}",
            line.label, line.name, line.state
        ));
        if line.error.is_some() {
            exit = exit.worst(if line.refused {
                Exit::Config
            } else {
                Exit::Unavailable
            });
        }
        sources.push(source_json(&line));
    }
    let claims = match &opened.pool {
        Some(pool) => {
            match retention::claims_summary(pool, &opened.tables, &pipeline_config.consumer).await {
                Ok(claims) => {
                    text.push(format!(
                        "  claims        {} (oldest {}, window {:?})",
                        claims.rows,
                        claims.oldest_age.map_or("-".to_string(), |age| format!(
                            "{:.0} s ago",
                            age.as_secs_f64()
                        )),
                        pipeline_config.retention.window
                    ));
                    json!({
                        "rows": claims.rows,
                        "oldest_age_seconds": claims.oldest_age.map(|age| age.as_secs_f64()),
                        "window_seconds": pipeline_config.retention.window.as_secs(),
                    })
                }
                Err(error) => {
                    text.push(format!("  claims        unknown ({error})"));
                    exit = exit.worst(Exit::Unavailable);
                    json!({ "error": error.to_string() })
                }
            }
        }
        None => json!({ "error": format!("{} unreachable", database::label(opened.name)) }),
    };
    let json = json!({
        "name": pipeline_config.name,
        "consumer": pipeline_config.consumer,
        "database": database::label(pipeline_config.database.as_deref()),
        "plugin": { "file": pipeline_config.plugin.display().to_string(), "build": build },
        "source": sources,
        "claims": claims,
    });
    (text, json, exit)
}

/// A source line as JSON: its figures, or why they are unknown.
fn source_json(line: &StatusLine) -> Value {
    let mut json = json!({ "kind": line.label, "name": line.name, "state": line.state });
    for (figure, value) in &line.figures {
        json[*figure] = json!(value);
    }
    if let Some(error) = &line.error {
        json["error"] = json!(error);
        json["refused"] = json!(line.refused);
    }
    json
}

/// One database's line (its outbox's backlog, or that it is out of reach) and its JSON.
async fn database_status(
    config: &Config,
    opened: &Opened<'_>,
    several: bool,
) -> (Option<String>, Value) {
    let label = database::label(opened.name);
    // `outbox of [databases.billing]: …` when there are several.
    let of = if several {
        format!(" of {label}")
    } else {
        String::new()
    };
    let mut json = json!({ "database": label, "reachable": opened.pool.is_some() });
    let line = match &opened.pool {
        Some(pool) if config.outbox.is_some() => {
            match outbox::backlog(pool, &opened.tables).await {
                Ok(backlog) => {
                    json["outbox"] = json!({
                        "pending": backlog.pending,
                        "parked": backlog.parked,
                        "delivered": backlog.delivered,
                    });
                    Some(format!(
                        "outbox{of}: {} pending, {} parked, {} delivered (kept for retention)",
                        backlog.pending, backlog.parked, backlog.delivered
                    ))
                }
                Err(error) => {
                    json["outbox"] = json!({ "error": error.to_string() });
                    Some(format!("outbox{of}: unknown ({error})"))
                }
            }
        }
        Some(_) => None,
        None => Some(format!("({label} unreachable: its claims not shown)")),
    };
    (line, json)
}

/// The plugin file's build and the contract it was built for, read without compiling it.
fn plugin_build(path: &Path) -> String {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) => return format!("unreadable: {error}"),
    };
    let contract = contract::of_component(&bytes).map_or_else(
        || format!("no {} contract", contract::PACKAGE),
        |version| contract::describe(&version),
    );
    format!("{}, {contract}", idem_host::sandbox::digest(&bytes))
}
