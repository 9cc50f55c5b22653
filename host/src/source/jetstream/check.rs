//! What `idem check` and `idem status` see of JetStream pipelines, through
//! [`source::check`](super::super::check) and [`source::status`](super::super::status).

use super::{Found, inspect};
use crate::config::{JetStreamConfig, PipelineConfig};
use crate::source::{Finding, StatusLine};

/// Connects to each pipeline's servers as `idem run` would and looks at its stream and
/// consumer without creating either.
pub async fn check(pipelines: &[(&PipelineConfig, &JetStreamConfig)]) -> Vec<Finding> {
    let mut findings = Vec::with_capacity(pipelines.len());
    for (pipeline, source) in pipelines {
        let name = &pipeline.name;
        findings.push(match inspect(source, Some(pipeline.max_attempts)).await {
            Ok(Found::StreamMissing) => Finding::Ok(format!(
                "pipeline {name:?}: stream {:?} will be created by idem run",
                source.stream
            )),
            Ok(Found::ConsumerMissing { messages }) => Finding::Ok(format!(
                "pipeline {name:?}: stream {:?} exists ({messages} messages); consumer {:?} will be created by idem run",
                source.stream, source.consumer
            )),
            Ok(Found::Ready { messages, .. }) => Finding::Ok(format!(
                "pipeline {name:?}: stream {:?} ({messages} messages) and consumer {:?} match",
                source.stream, source.consumer
            )),
            Err(error) => Finding::failed("", error),
        });
    }
    findings
}

/// What `source`'s stream holds for its consumer.
pub async fn status(source: &JetStreamConfig) -> Vec<StatusLine> {
    let name = source.stream.clone();
    let line = match inspect(source, None).await {
        Ok(Found::StreamMissing) => {
            StatusLine::known("stream", name, "not created yet".to_string(), Vec::new())
        }
        Ok(Found::ConsumerMissing { messages }) => StatusLine::known(
            "stream",
            name,
            format!("{messages} messages; consumer not created yet"),
            vec![("messages", messages)],
        ),
        Ok(Found::Ready {
            messages,
            pending,
            unacknowledged,
            dead_letters,
        }) => {
            let mut figures = vec![
                ("messages", messages),
                ("not_delivered", pending),
                ("unacknowledged", unacknowledged),
            ];
            figures.extend(dead_letters.map(|count| ("dead_letters", count)));
            StatusLine::known(
                "stream",
                name,
                format!(
                    "{messages} messages, {pending} not delivered, {unacknowledged} unacknowledged; dead letters: {}",
                    dead_letters.map_or("none yet".to_string(), |count| count.to_string())
                ),
                figures,
            )
        }
        Err(error) => StatusLine::unknown("stream", name, error),
    };
    vec![line]
}
