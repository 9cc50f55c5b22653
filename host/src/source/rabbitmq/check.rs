//! What `idem check` and `idem status` see of RabbitMQ pipelines, through
//! [`source::check`](super::super::check) and [`source::status`](super::super::status).

use lapin::types::ShortString;

use super::topology::{self, Found, Role};
use super::{connect, queue_depth};
use crate::config::{AmqpConfig, PipelineConfig, RabbitMqConfig};
use crate::source::{Finding, StatusLine};

/// Connects to each of `brokers` as `idem run` would and checks the queues of the
/// `pipelines` that consume there, declaring none.
pub async fn check(
    brokers: &[&AmqpConfig],
    pipelines: &[(&PipelineConfig, &RabbitMqConfig)],
) -> Vec<Finding> {
    let mut findings = Vec::new();
    for broker in brokers {
        let connection = match connect(broker, "idem check".into()).await {
            Ok(connection) => connection,
            Err(error) => {
                findings.push(Finding::failed("", error));
                continue;
            }
        };
        findings.push(Finding::Ok(format!(
            "RabbitMQ at {}: credentials and vhost accepted",
            broker.endpoints()
        )));
        for (pipeline, queues) in pipelines {
            if &queues.broker == *broker {
                check_queues(&connection, pipeline, queues, &mut findings).await;
            }
        }
        let _ = connection.close(200, ShortString::from("check done")).await;
    }
    findings
}

/// `pipeline`'s queue and dead-letter queue as they are on the broker.
async fn check_queues(
    connection: &lapin::Connection,
    pipeline: &PipelineConfig,
    queues: &RabbitMqConfig,
    findings: &mut Vec<Finding>,
) {
    for role in [Role::Consumed, Role::DeadLetter] {
        let queue = role.queue(queues);
        let label = match role {
            Role::Consumed => "queue",
            Role::DeadLetter => "dead-letter queue",
        };
        let declared = topology::describe(queues, role);
        findings.push(
            match topology::ensure(connection, queues, role, false).await {
                Ok(Found::Exists { ready, .. }) => {
                    let how = if queues.declare {
                        format!("matches {declared}")
                    } else {
                        "used as your infrastructure declared it".to_string()
                    };
                    Finding::Ok(format!(
                        "pipeline {:?}: {label} {queue:?} exists ({how}; {ready} ready)",
                        pipeline.name
                    ))
                }
                Ok(Found::Missing | Found::Declared) => Finding::Ok(format!(
                    "pipeline {:?}: {label} {queue:?} will be declared by idem run ({declared})",
                    pipeline.name
                )),
                Err(error) => Finding::failed("", error),
            },
        );
    }
}

/// What `queues`' queue and dead-letter queue hold.
pub async fn status(queues: &RabbitMqConfig) -> Vec<StatusLine> {
    let mut lines = Vec::with_capacity(2);
    for (label, queue) in [
        ("queue", &queues.queue),
        ("dead letters", &queues.dead_letter_queue),
    ] {
        let name = queue.clone();
        lines.push(match queue_depth(&queues.broker, queue).await {
            Ok(Some(depth)) => StatusLine::known(
                label,
                name,
                format!("{} ready, {} consumers", depth.ready, depth.consumers),
                vec![
                    ("ready", u64::from(depth.ready)),
                    ("consumers", u64::from(depth.consumers)),
                ],
            ),
            Ok(None) => StatusLine::known(label, name, "not declared yet".to_string(), Vec::new()),
            Err(error) => StatusLine::unknown(label, name, error),
        });
    }
    lines
}
