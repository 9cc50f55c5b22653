//! `idem check`: is this config ready to run.

use std::path::Path;
use std::process::ExitCode;

use idem_host::config::{AmqpConfig, Config, Destination};
use idem_host::pipeline;
use idem_host::sandbox::PluginRuntime;
use idem_host::source::{jetstream, rabbitmq};
use idem_host::store::database;
use idem_host::store::statement::StatementCatalog;

use crate::ConfigArg;

/// Validate the config, compile every plugin, prepare every statement, and check RabbitMQ
/// (credentials, vhost, every queue's existence and arguments); list every problem.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    /// Check the file and the plugins only; contact neither PostgreSQL nor RabbitMQ.
    #[arg(long)]
    offline: bool,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        check(&self.config.config, self.offline).await
    }
}

/// Collects every problem instead of stopping at the first.
async fn check(path: &Path, offline: bool) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let runtime = PluginRuntime::for_config(&config)?;
    let mut problems = Vec::new();
    if let Some(outbox) = &config.outbox
        && let Err(error) = idem_host::store::outbox::http_clients(outbox)
    {
        problems.push(error.to_string());
    }
    let mut plugins = Vec::with_capacity(config.pipelines.len());
    for pipeline_config in &config.pipelines {
        match pipeline::load_plugin(&runtime, pipeline_config).await {
            Ok(plugin) => {
                println!(
                    "ok   pipeline {:?}: plugin {} ({})",
                    pipeline_config.name,
                    plugin.path.display(),
                    plugin.digest
                );
                plugins.push(Some(plugin));
            }
            Err(error) => {
                problems.push(error.to_string());
                plugins.push(None);
            }
        }
    }
    // The statements each pipeline's self-test is checked against: as PostgreSQL prepares
    // them, or, offline, as the config declares them.
    let mut catalogs: Vec<Option<StatementCatalog>> = Vec::with_capacity(config.pipelines.len());
    if offline {
        catalogs.extend(
            config
                .pipelines
                .iter()
                .map(|pipeline_config| Some(StatementCatalog::from_config(pipeline_config))),
        );
    } else {
        check_brokers(&config, &mut problems).await;
        check_streams(&config, &mut problems).await;
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
                        Ok(catalog) => {
                            println!(
                                "ok   pipeline {:?}: {} statements prepare",
                                pipeline_config.name,
                                pipeline_config.statements.len()
                            );
                            catalogs.push(Some(catalog));
                        }
                        Err(errors) => {
                            problems.extend(errors.0.iter().map(ToString::to_string));
                            catalogs.push(None);
                        }
                    }
                }
            }
        }
    }
    for ((pipeline_config, plugin), catalog) in config.pipelines.iter().zip(&plugins).zip(&catalogs)
    {
        let (Some(plugin), Some(catalog)) = (plugin, catalog) else {
            continue;
        };
        if pipeline_config.self_test.is_none() && pipeline_config.cases.is_none() {
            continue;
        }
        match pipeline::self_test(&runtime, pipeline_config, catalog, plugin).await {
            Ok(()) => println!(
                "ok   pipeline {:?}: plugin passes its self-test",
                pipeline_config.name
            ),
            Err(error) => problems.push(error.to_string()),
        }
    }
    let note = if offline {
        " (offline: PostgreSQL and the brokers not checked; effects checked for statement names and parameter counts)"
    } else {
        ""
    };
    Ok(verdict(&config, &problems, note))
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

/// Connects to each JetStream pipeline's servers as `idem run` would and looks at its stream
/// and consumer without creating either.
async fn check_streams(config: &Config, problems: &mut Vec<String>) {
    for pipeline_config in &config.pipelines {
        let Some(source) = jetstream::settings(pipeline_config) else {
            continue;
        };
        let name = &pipeline_config.name;
        match jetstream::inspect(source).await {
            Ok(jetstream::Found::StreamMissing) => println!(
                "ok   pipeline {name:?}: stream {:?} will be created by idem run",
                source.stream
            ),
            Ok(jetstream::Found::ConsumerMissing { messages }) => println!(
                "ok   pipeline {name:?}: stream {:?} exists ({messages} messages); consumer {:?} will be created by idem run",
                source.stream, source.consumer
            ),
            Ok(jetstream::Found::Ready { messages, .. }) => println!(
                "ok   pipeline {name:?}: stream {:?} ({messages} messages) and consumer {:?} match",
                source.stream, source.consumer
            ),
            Err(error) => problems.push(error.to_string()),
        }
    }
}

/// Connects to each RabbitMQ broker (of pipelines and outbox destinations) as `idem run`
/// would and checks every pipeline's queues on it without declaring any.
async fn check_brokers(config: &Config, problems: &mut Vec<String>) {
    let destinations = config
        .outbox
        .iter()
        .flat_map(|outbox| outbox.destinations.values())
        .filter_map(|destination| match destination {
            Destination::Amqp { broker, .. } => Some(broker),
            Destination::Http { .. } => None,
        });
    let mut brokers: Vec<&AmqpConfig> = Vec::new();
    for broker in config
        .pipelines
        .iter()
        .filter_map(|pipeline| rabbitmq::queues(pipeline).ok())
        .map(|queues| &queues.broker)
        .chain(destinations)
    {
        if !brokers.contains(&broker) {
            brokers.push(broker);
        }
    }
    for broker in brokers {
        check_broker(config, broker, problems).await;
    }
}

/// Connects to `broker` and checks the queues of the pipelines that consume there.
async fn check_broker(config: &Config, broker: &AmqpConfig, problems: &mut Vec<String>) {
    use rabbitmq::topology::{self, Found, Role};
    let endpoint = idem_host::config::redact_url(&broker.url);
    let connection = match rabbitmq::connect(broker, "idem check".into()).await {
        Ok(connection) => connection,
        Err(error) => {
            problems.push(error.to_string());
            return;
        }
    };
    println!("ok   RabbitMQ at {endpoint}: credentials and vhost accepted");
    for pipeline_config in &config.pipelines {
        let Ok(queues) = rabbitmq::queues(pipeline_config) else {
            continue;
        };
        if &queues.broker != broker {
            continue;
        }
        for role in [Role::Consumed, Role::DeadLetter] {
            let queue = role.queue(queues);
            let label = match role {
                Role::Consumed => "queue",
                Role::DeadLetter => "dead-letter queue",
            };
            let declared = topology::describe(queues, role);
            match topology::ensure(&connection, queues, role, false).await {
                Ok(Found::Exists { ready, .. }) => {
                    let how = if queues.declare {
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
