//! The two queues of a pipeline, the one it consumes and its dead-letter queue: declared as
//! configured (type, arguments, and for quorum queues the broker's own dead-lettering into
//! the dead-letter queue), or only checked to exist when infrastructure code owns them
//! (`declare = false`). A queue that exists with other arguments is a configuration fault.

use std::collections::BTreeMap;

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection};

use super::AmqpError;
use super::connect::{ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED, reply};
use crate::config::{QueueArgument, QueueType, RabbitMqConfig};

/// Which of a pipeline's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The queue the pipeline consumes.
    Consumed,
    /// Where rejected messages go (and, for quorum queues, messages over the delivery limit).
    DeadLetter,
}

impl Role {
    pub fn queue(self, queues: &RabbitMqConfig) -> &str {
        match self {
            Role::Consumed => &queues.queue,
            Role::DeadLetter => &queues.dead_letter_queue,
        }
    }

    fn key(self) -> &'static str {
        match self {
            Role::Consumed => "queue",
            Role::DeadLetter => "dead_letter_queue",
        }
    }
}

/// What the broker has, for one queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// The queue exists; when idem declares it, its arguments match the configuration.
    Exists { ready: u32, consumers: u32 },
    /// It did not exist and was declared now.
    Declared,
    /// It does not exist; `idem run` will declare it.
    Missing,
}

/// Makes sure `role`'s queue is there as configured: checks it when it exists (its arguments
/// too, when idem declares it), declares it when missing and idem may (`create`), and turns
/// the broker's refusals into configuration faults naming the setting.
pub async fn ensure(
    connection: &Connection,
    queues: &RabbitMqConfig,
    role: Role,
    create: bool,
) -> Result<Found, AmqpError> {
    let queue = role.queue(queues);
    // The dead-letter queue is idem's own even when the consumed queue is not: it is
    // declared when missing, and used as it is when it exists.
    let may_declare = queues.declare || role == Role::DeadLetter;
    let channel = open_channel(connection, queues, role).await?;
    match inspect(&channel, queue).await {
        Ok(existing) => {
            if queues.declare {
                // Declaring an existing queue with the same arguments changes nothing; with
                // other arguments the broker refuses and names the difference.
                declare(&channel, queues, role)
                    .await
                    .map_err(|error| refusal(queues, role, "declare", error))?;
            }
            close(channel).await;
            Ok(Found::Exists {
                ready: existing.message_count(),
                consumers: existing.consumer_count(),
            })
        }
        // "no queue 'x' in vhost '/'"; other NOT_FOUNDs ("home node … is down or
        // inaccessible" while a cluster node restarts) pass and are retried.
        Err(error)
            if reply(&error)
                .is_some_and(|(code, text)| code == NOT_FOUND && text.contains("no queue")) =>
        {
            if !may_declare {
                return Err(AmqpError::Refused {
                    subject: format!("{}.queue {queue:?}", queues.table),
                    reason: "it does not exist".into(),
                    setting: format!(
                        "{}.queue and declare = false: with declare = false the queue must be declared by your infrastructure before idem starts (or remove declare = false and idem declares it)",
                        queues.table
                    ),
                });
            }
            if !create {
                return Ok(Found::Missing);
            }
            // The failed passive declare closed that channel.
            let channel = open_channel(connection, queues, role).await?;
            declare(&channel, queues, role)
                .await
                .map_err(|error| refusal(queues, role, "declare", error))?;
            close(channel).await;
            Ok(Found::Declared)
        }
        Err(error) => Err(refusal(queues, role, "inspect", error)),
    }
}

/// The arguments idem declares `role`'s queue with.
pub fn arguments(queues: &RabbitMqConfig, role: Role) -> FieldTable {
    let mut arguments = BTreeMap::new();
    let mut text = |name: &str, value: &str| {
        arguments.insert(
            ShortString::from(name),
            AMQPValue::LongString(LongString::from(value)),
        );
    };
    if queues.queue_type == QueueType::Quorum {
        text("x-queue-type", "quorum");
        let own_dead_lettering = queues
            .queue_arguments
            .keys()
            .any(|name| name.starts_with("x-dead-letter-"));
        if role == Role::Consumed && !own_dead_lettering {
            // A message over the delivery limit goes to the dead-letter queue, with `x-death`,
            // and the broker keeps it until that queue confirms it (at-least-once, which
            // needs reject-publish overflow).
            text("x-dead-letter-exchange", "");
            text("x-dead-letter-routing-key", &queues.dead_letter_queue);
            text("x-dead-letter-strategy", "at-least-once");
            if !queues.queue_arguments.contains_key("x-overflow") {
                text("x-overflow", "reject-publish");
            }
        }
    }
    if role == Role::Consumed {
        for (name, value) in &queues.queue_arguments {
            let value = match value {
                QueueArgument::Integer(integer) => AMQPValue::LongLongInt(*integer),
                QueueArgument::Boolean(flag) => AMQPValue::Boolean(*flag),
                QueueArgument::Text(text) => AMQPValue::LongString(LongString::from(text.as_str())),
            };
            arguments.insert(ShortString::from(name.as_str()), value);
        }
    }
    arguments.into()
}

/// Declares `queue` passively: its depth and consumers, or an error if it does not exist.
pub(super) async fn inspect(channel: &Channel, queue: &str) -> Result<lapin::Queue, lapin::Error> {
    channel
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
}

async fn declare(
    channel: &Channel,
    queues: &RabbitMqConfig,
    role: Role,
) -> Result<lapin::Queue, lapin::Error> {
    channel
        .queue_declare(
            ShortString::from(role.queue(queues)),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments(queues, role),
        )
        .await
}

async fn open_channel(
    connection: &Connection,
    queues: &RabbitMqConfig,
    role: Role,
) -> Result<Channel, AmqpError> {
    connection
        .create_channel()
        .await
        .map_err(|source| AmqpError::Topology {
            action: "open a channel for",
            queue: role.queue(queues).to_string(),
            source,
        })
}

async fn close(channel: Channel) {
    let _ = channel.close(200, ShortString::from("checked")).await;
}

/// A broker refusal about `role`'s queue: a configuration fault naming the setting when the
/// queue is declared otherwise or not permitted, a passing fault otherwise.
pub(super) fn refusal(
    queues: &RabbitMqConfig,
    role: Role,
    action: &'static str,
    error: lapin::Error,
) -> AmqpError {
    let queue = role.queue(queues);
    let setting = match reply(&error) {
        Some((PRECONDITION_FAILED, _)) => match role {
            Role::Consumed => format!(
                "{table}.queue_type and queue_arguments: they must match how {queue:?} was declared (idem declares it {declared}), or set declare = false to use the queue as it is",
                table = queues.table,
                declared = describe(queues, role),
            ),
            Role::DeadLetter => format!(
                "{table}.dead_letter_queue and queue_type: {queue:?} exists with other arguments than idem declares ({declared}); name another dead-letter queue, or set queue_type to the type it has",
                table = queues.table,
                declared = describe(queues, role),
            ),
        },
        Some((ACCESS_REFUSED, _)) => format!(
            "the permissions of the user in [amqp] url: idem needs configure, write and read on {queue:?}"
        ),
        _ => {
            return AmqpError::Topology {
                action,
                queue: queue.to_string(),
                source: error,
            };
        }
    };
    AmqpError::Refused {
        subject: format!("{}.{} {queue:?}", queues.table, role.key()),
        reason: error.to_string(),
        setting,
    }
}

/// How idem declares `role`'s queue, for messages: `quorum, x-delivery-limit=5, …`.
pub fn describe(queues: &RabbitMqConfig, role: Role) -> String {
    let table = arguments(queues, role);
    let mut words = vec![match queues.queue_type {
        QueueType::Classic => "classic, durable".to_string(),
        QueueType::Quorum => "quorum".to_string(),
    }];
    for (name, value) in table.inner() {
        if name.as_str() == "x-queue-type" {
            continue;
        }
        let value = match value {
            AMQPValue::LongString(text) => {
                format!("{:?}", String::from_utf8_lossy(text.as_bytes()))
            }
            AMQPValue::LongLongInt(integer) => integer.to_string(),
            AMQPValue::Boolean(flag) => flag.to_string(),
            other => format!("{other:?}"),
        };
        words.push(format!("{}={value}", name.as_str()));
    }
    words.join(", ")
}
