//! `idem check`: is this config ready to run.

use std::path::Path;

use idem_host::config::Config;
use idem_host::pipeline;
use idem_host::sandbox::{LoadedPlugin, PluginRuntime, contract};
use idem_host::source::{self, Finding};
use idem_host::store::database;
use idem_host::store::statement::StatementCatalog;

use crate::exit::{self, Exit};
use crate::lookup::ConfigArg;
use crate::output::{FormatArg, print_json};

/// Validate the config, compile every plugin, prepare every statement, and check RabbitMQ
/// (credentials, vhost, every queue's existence and arguments); list every problem.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    /// Check the file and the plugins only; contact neither PostgreSQL nor RabbitMQ.
    #[arg(long)]
    offline: bool,
    #[command(flatten)]
    pub format: FormatArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let mut report = Report::new(self.format.is_json());
        check(&self.config.config, self.offline, &mut report).await?;
        let note = if self.offline {
            " (offline: PostgreSQL and the brokers not checked; effects checked for statement names and parameter counts)"
        } else {
            ""
        };
        report.verdict(&self.config.config, self.offline, note)
    }
}

/// What `idem check` found, printed as it goes in text, collected for `--format json`.
struct Report {
    json: bool,
    /// `ok` and `warn` lines, in order.
    lines: Vec<(&'static str, String)>,
    /// Each problem, with what it makes the command exit with: `Findings` for a problem to
    /// fix, `Unavailable` for a service out of reach.
    problems: Vec<(String, Exit)>,
}

impl Report {
    fn new(json: bool) -> Report {
        Report {
            json,
            lines: Vec::new(),
            problems: Vec::new(),
        }
    }

    fn ok(&mut self, line: String) {
        self.say("ok", line);
    }

    fn warn(&mut self, line: String) {
        self.say("warn", line);
    }

    fn say(&mut self, level: &'static str, line: String) {
        if !self.json {
            println!("{level:<4} {line}");
        }
        self.lines.push((level, line));
    }

    /// A problem to fix before `idem run`.
    fn problem(&mut self, problem: String) {
        self.problems.push((problem, Exit::Findings));
    }

    /// A service `idem run` would wait for.
    fn unreachable(&mut self, problem: String) {
        self.problems.push((problem, Exit::Unavailable));
    }

    /// Prints the problems and the verdict; exits `Findings` if one is a problem to fix,
    /// else `Unavailable` if a service was out of reach.
    fn verdict(self, path: &Path, offline: bool, note: &str) -> anyhow::Result<Exit> {
        let exit = self
            .problems
            .iter()
            .fold(Exit::Success, |exit, (_, found)| exit.worst(*found));
        if self.json {
            let lines = |level: &str| -> Vec<&str> {
                self.lines
                    .iter()
                    .filter(|(said, _)| *said == level)
                    .map(|(_, line)| line.as_str())
                    .collect()
            };
            let problems: Vec<_> = self
                .problems
                .iter()
                .map(|(problem, found)| {
                    serde_json::json!({
                        "problem": problem,
                        "unreachable": *found == Exit::Unavailable,
                    })
                })
                .collect();
            print_json(&serde_json::json!({
                "config": path.display().to_string(),
                "offline": offline,
                "ready": self.problems.is_empty(),
                "ok": lines("ok"),
                "warnings": lines("warn"),
                "problems": problems,
                "exit": exit.code(),
            }))?;
            return Ok(exit);
        }
        for (problem, _) in &self.problems {
            println!("FAIL {problem}");
        }
        if self.problems.is_empty() {
            println!("{} is ready to run{note}", path.display());
        } else {
            println!("{} problem(s) found{note}", self.problems.len());
        }
        Ok(exit)
    }
}

/// Collects every problem instead of stopping at the first.
async fn check(path: &Path, offline: bool, report: &mut Report) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    let runtime = PluginRuntime::for_config(&config)?;
    if let Err(error) = config.require_pipelines() {
        report.problem(error.to_string());
    }
    if let Some(outbox) = &config.outbox
        && let Err(error) = idem_host::relay::http_clients(outbox)
    {
        report.problem(error.to_string());
    }
    let plugins = load_plugins(&runtime, &config, report).await;
    // The statements each pipeline's self-test is checked against: as PostgreSQL prepares
    // them, or, offline, as the config declares them.
    let catalogs: Vec<Option<StatementCatalog>> = if offline {
        config
            .pipelines
            .iter()
            .map(|pipeline_config| Some(StatementCatalog::from_config(pipeline_config)))
            .collect()
    } else {
        for finding in source::check(&config).await {
            match finding {
                Finding::Ok(line) => report.ok(line),
                Finding::Problem(problem) => report.problem(problem),
                Finding::Unreachable(problem) => report.unreachable(problem),
            }
        }
        prepare_statements(&config, report).await
    };
    for ((pipeline_config, plugin), catalog) in config.pipelines.iter().zip(&plugins).zip(&catalogs)
    {
        let (Some(plugin), Some(catalog)) = (plugin, catalog) else {
            continue;
        };
        if pipeline_config.self_test.is_none() && pipeline_config.cases.is_none() {
            continue;
        }
        match pipeline::self_test(&runtime, pipeline_config, catalog, plugin).await {
            Ok(()) => report.ok(format!(
                "pipeline {:?}: plugin passes its self-test",
                pipeline_config.name
            )),
            Err(error) => report.problem(error.to_string()),
        }
    }
    Ok(())
}

/// Each pipeline's plugin, compiled and checked against the contract; `None` for one that
/// failed, with its problem.
async fn load_plugins(
    runtime: &PluginRuntime,
    config: &Config,
    report: &mut Report,
) -> Vec<Option<LoadedPlugin>> {
    let mut plugins = Vec::with_capacity(config.pipelines.len());
    for pipeline_config in &config.pipelines {
        match pipeline::load_plugin(runtime, pipeline_config).await {
            Ok(plugin) => {
                report.ok(format!(
                    "pipeline {:?}: plugin {} ({}, {})",
                    pipeline_config.name,
                    plugin.path.display(),
                    plugin.digest,
                    contract::describe(&plugin.contract)
                ));
                if let Some(deprecation) = contract::deprecation(&plugin.contract) {
                    report.warn(format!(
                        "pipeline {:?}: plugin {deprecation}",
                        pipeline_config.name
                    ));
                }
                plugins.push(Some(plugin));
            }
            Err(error) => {
                report.problem(error.to_string());
                plugins.push(None);
            }
        }
    }
    plugins
}

/// Connects to every database, checks idem's tables in each, and prepares each pipeline's
/// statements in its database; `None` for a pipeline whose statements failed, or whose
/// database cannot be reached, with their problems.
async fn prepare_statements(config: &Config, report: &mut Report) -> Vec<Option<StatementCatalog>> {
    let mut opened = Vec::new();
    for (name, database_config) in config.all_databases() {
        match database::open(database_config).await {
            Ok(database) => {
                let outbox = config.outbox.is_some();
                match database::check_schema(&database.pool, database_config, outbox).await {
                    Ok(()) => report.ok(format!(
                        "{}: idem's tables in {}",
                        database::label(name),
                        database.tables.place()
                    )),
                    Err(error) => report.problem(error.to_string()),
                }
                opened.push((name, Some(database)));
            }
            Err(error) => {
                if exit::of_database(&error) == Exit::Unavailable {
                    report.unreachable(error.to_string());
                } else {
                    report.problem(error.to_string());
                }
                opened.push((name, None));
            }
        }
    }
    let mut catalogs = Vec::with_capacity(config.pipelines.len());
    for pipeline_config in &config.pipelines {
        let database = opened
            .iter()
            .find(|(name, _)| *name == pipeline_config.database.as_deref())
            .and_then(|(_, database)| database.as_ref());
        let Some(database) = database else {
            catalogs.push(None);
            continue;
        };
        match StatementCatalog::prepare(&database.sessions, pipeline_config).await {
            Ok(catalog) => {
                report.ok(format!(
                    "pipeline {:?}: {} statements prepare",
                    pipeline_config.name,
                    pipeline_config.statements.len()
                ));
                catalogs.push(Some(catalog));
            }
            Err(errors) => {
                for error in &errors.0 {
                    report.problem(error.to_string());
                }
                catalogs.push(None);
            }
        }
    }
    catalogs
}
