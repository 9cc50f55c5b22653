//! `idem try`: a plugin's decision on one message without a broker, checked against the
//! pipeline's statements as `idem run` would check them. `idem test` shares how a pipeline
//! and its statements are found.

use std::path::{Path, PathBuf};

use anyhow::Context;

use idem_host::cases::{self, Origin};
use idem_host::config::Config;
use idem_host::effect::Outcome;
use idem_host::pipeline;
use idem_host::sandbox::PluginRuntime;

use crate::exit::Exit;
use crate::lookup::{ConfigArg, pipeline_named, statements};

/// Run a pipeline's plugin on one message and print its decision (no broker); its effects
/// are checked against the pipeline's statements (types too when PostgreSQL is reachable).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    /// The pipeline whose plugin and limits to use.
    #[arg(long, short)]
    pipeline: String,
    /// A file holding the message body (`-` reads stdin).
    #[arg(long, short)]
    message: PathBuf,
    #[command(flatten)]
    delivery: Delivery,
    /// Check effects against the config's statements without contacting PostgreSQL.
    #[arg(long)]
    offline: bool,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        try_message(
            &self.config.config,
            &self.pipeline,
            &self.message,
            self.delivery,
            self.offline,
        )
        .await
    }
}

/// The delivery properties `idem try` sets from its flags.
#[derive(clap::Args)]
struct Delivery {
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
}

async fn try_message(
    path: &Path,
    pipeline_name: &str,
    message: &Path,
    delivery: Delivery,
    offline: bool,
) -> anyhow::Result<Exit> {
    let config = Config::load(path)?;
    let pipeline_config = pipeline_named(&config, pipeline_name)?;
    let body = if message == Path::new("-") {
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut body)
            .context("cannot read the message from stdin")?;
        body
    } else {
        std::fs::read(message).with_context(|| format!("cannot read message {message:?}"))?
    };
    let headers = delivery
        .headers
        .iter()
        .map(|header| {
            header
                .split_once('=')
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .with_context(|| format!("--header {header:?}: write it as NAME=VALUE"))
        })
        .collect::<anyhow::Result<_>>()?;
    let runtime = PluginRuntime::for_config(&config)?;
    let plugin = pipeline::load_plugin(&runtime, pipeline_config).await?;
    let subject = delivery
        .subject
        .unwrap_or_else(|| pipeline_config.queue().to_string());
    let mut inbound = Origin::of(pipeline_config).message(body, &subject);
    inbound.headers = headers;
    inbound.message_id = delivery.message_id;
    inbound.redelivered = delivery.redelivered;
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
    println!(
        "{}",
        serde_json::to_string_pretty(&cases::outcome_json(&outcome))?
    );
    match &outcome {
        Ok(Outcome::Decision(decision)) => {
            let statements = statements(&config, pipeline_config, offline).await;
            match cases::fit(pipeline_config, &statements, decision) {
                Ok(()) => Ok(Exit::Success),
                Err(error) => {
                    eprintln!(
                        "idem try: this decision would be rejected by pipeline {:?}: {error}",
                        pipeline_config.name
                    );
                    Ok(Exit::Findings)
                }
            }
        }
        Ok(Outcome::Skip { .. }) => Ok(Exit::Success),
        Err(_) => Ok(Exit::Findings),
    }
}
