//! A plugin run on cases as a pipeline would run it: the origin a case's message comes
//! from, the plugin's outcome compared with the expected one, and whether its effects fit
//! the pipeline's statements.

use crate::config::{PipelineConfig, PluginLimits};
use crate::effect::{Decision, Outcome};
use crate::message::InboundMessage;
use crate::sandbox::{LoadedPlugin, PluginRuntime};
use crate::source;
use crate::store::ledger::{Plan, PlanError};
use crate::store::statement::{BoundEffect, StatementCatalog};

use super::Case;

/// Checks a decision's effects against a pipeline as `idem run` would before opening a
/// transaction: statement names, parameter counts and types (the types the server declared
/// when `statements` was prepared, or each value's own type when it was built from the
/// config), outbox destinations, and the natural claim's statement.
pub fn fit(
    pipeline: &PipelineConfig,
    statements: &StatementCatalog,
    decision: &Decision,
) -> Result<(), PlanError> {
    let plan = Plan::build(pipeline, statements, decision, "", false)?;
    match plan.effects.iter().find_map(BoundEffect::out_of_range) {
        Some(error) => Err(PlanError::Effect(error.clone())),
        None => Ok(()),
    }
}

/// The pipeline a case's message is delivered to, as its plugin sees it.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    pub pipeline: &'a str,
    /// The source kind (`rabbitmq`).
    pub source: &'a str,
    /// The queue (or stream) consumed.
    pub queue: &'a str,
}

impl<'a> Origin<'a> {
    /// Where `pipeline`'s messages come from.
    pub fn of(pipeline: &'a PipelineConfig) -> Origin<'a> {
        Origin {
            pipeline: &pipeline.name,
            source: pipeline.source_kind(),
            queue: pipeline.queue(),
        }
    }

    /// `body` as a plain publish to `subject` would arrive: no headers, no message id, a
    /// first delivery; for RabbitMQ, through the default exchange.
    pub fn message(&self, body: Vec<u8>, subject: &str) -> InboundMessage {
        let attributes = source::published_attributes(self.source, subject);
        InboundMessage {
            pipeline: self.pipeline.to_string(),
            source: self.source.to_string(),
            queue: self.queue.to_string(),
            subject: subject.to_string(),
            body,
            attributes,
            ..InboundMessage::default()
        }
    }
}

/// A plugin run on cases as a pipeline would run it.
pub struct Trial<'a> {
    pub runtime: &'a PluginRuntime,
    pub plugin: &'a LoadedPlugin,
    pub limits: &'a PluginLimits,
    /// Where the cases' messages come from.
    pub origin: Origin<'a>,
    /// When given, every decision's effects must also [`fit`] this pipeline.
    pub fit: Option<(&'a PipelineConfig, &'a StatementCatalog)>,
}

impl Trial<'_> {
    /// How the plugin's outcome for `case` differs from the expected one, and why its effects
    /// would not run in the pipeline; empty when the case passes.
    pub async fn differences(&self, case: &Case) -> Vec<String> {
        let message = case.message(&self.origin);
        let outcome = self
            .runtime
            .invoke(self.plugin, self.limits, &message)
            .await;
        let mut differences = case.differences(&outcome);
        if let (Some((pipeline, statements)), Ok(Outcome::Decision(decision))) =
            (self.fit, &outcome)
            && let Err(error) = fit(pipeline, statements, decision)
        {
            differences.push(format!(
                "effects: pipeline {:?} would reject this decision: {error}",
                pipeline.name
            ));
        }
        differences
    }
}
