//! What `idem check` and `idem status` see of Kafka pipelines, through
//! [`source::check`](super::super::check) and [`source::status`](super::super::status).

use crate::config::{KafkaConfig, PipelineConfig};
use crate::source::{Finding, StatusLine};

use super::KafkaError;
use super::depths::{Found, inspect};
use super::topology::reader;

/// What the brokers say of `source` (its topics, the group's offsets, the dead letters).
async fn look(source: &KafkaConfig, client: &str) -> Result<Found, KafkaError> {
    let source = source.clone();
    let client = client.to_string();
    tokio::task::spawn_blocking(move || inspect(&reader(&source, &client)?, &source))
        .await
        .map_err(|error| KafkaError::Client(error.to_string()))?
}

/// Connects to each pipeline's brokers as `idem run` would and looks at its topics and its
/// group's committed offsets, creating nothing.
pub async fn check(pipelines: &[(&PipelineConfig, &KafkaConfig)]) -> Vec<Finding> {
    let mut findings = Vec::with_capacity(pipelines.len());
    for (pipeline, source) in pipelines {
        let name = &pipeline.name;
        findings.push(match look(source, "idem check").await {
            Ok(found) if !found.missing.is_empty() && !source.declare => Finding::Problem(format!(
                "pipeline {name:?}: the topics {:?} do not exist, and declare = false leaves them to you ({})",
                found.missing, source.table
            )),
            Ok(found) => {
                let partitions = found.waiting.len();
                let waiting: u64 = found.waiting.values().sum();
                let missing = if found.missing.is_empty() {
                    String::new()
                } else {
                    format!("; {:?} will be created by idem run", found.missing)
                };
                let group = if found.committed {
                    format!("group {:?} has committed offsets", source.group)
                } else {
                    format!(
                        "group {:?} has no committed offset yet (it starts at {:?})",
                        source.group, source.start
                    )
                };
                Finding::Ok(format!(
                    "pipeline {name:?}: {partitions} partitions of {:?}, {waiting} messages waiting; {group}; dead-letter topic {:?} {}{missing}",
                    source.topics,
                    source.dead_letter_topic,
                    match found.dead_letters {
                        Some(_) => "exists",
                        None => "will be created by idem run",
                    }
                ))
            }
            Err(error) => Finding::failed(&format!("pipeline {name:?}: "), error),
        });
    }
    findings
}

/// What `source`'s topics hold for its group.
pub async fn status(source: &KafkaConfig) -> Vec<StatusLine> {
    let name = source.topics.join(",");
    let line = match look(source, "idem status").await {
        Ok(found) => {
            let waiting = found.waiting.values().sum::<u64>();
            let mut figures = vec![
                ("partitions", found.waiting.len() as u64),
                ("not_committed", waiting),
            ];
            figures.extend(found.dead_letters.map(|count| ("dead_letters", count)));
            StatusLine::known(
                "topic",
                name,
                format!(
                    "{} partitions, {waiting} messages not committed by group {:?}; dead letters: {}",
                    found.waiting.len(),
                    source.group,
                    found
                        .dead_letters
                        .map_or("none yet".to_string(), |count| count.to_string())
                ),
                figures,
            )
        }
        Err(error) => StatusLine::unknown("topic", name, error),
    };
    vec![line]
}
