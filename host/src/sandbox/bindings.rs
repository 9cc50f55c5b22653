//! The generated WIT bindings, and their conversion to host types. No other file names them.

use crate::effect::{Decision, Effect, Failure, FailureKind, OutboxMessage, Outcome, Value};
use crate::message::InboundMessage;
use crate::sandbox::{PLUGIN_TEXT_BYTES, printable};

wasmtime::component::bindgen!({
    path: "../wit",
    world: "plugin",
    exports: { default: async },
});

/// The contract these bindings were generated from, as `wit/world.wit` holds it: what
/// `idem wit` hands to plugin authors, so a plugin builds against exactly this host's WIT.
pub const WORLD_WIT: &str = include_str!("../../../wit/world.wit");

pub use idem::plugin::log;
use idem::plugin::types;

pub fn message(inbound: &InboundMessage) -> types::Message {
    types::Message {
        pipeline: inbound.pipeline.clone(),
        source: inbound.source.clone(),
        queue: inbound.queue.clone(),
        subject: inbound.subject.clone(),
        body: inbound.body.clone(),
        headers: inbound.headers.clone(),
        message_id: inbound.message_id.clone(),
        redelivered: inbound.redelivered,
        delivery_count: inbound.delivery_count,
        attributes: inbound.attributes.clone(),
    }
}

pub fn verdict(result: Result<types::Outcome, types::Failure>) -> Result<Outcome, Failure> {
    match result {
        Ok(types::Outcome::Decision(decision)) => Ok(Outcome::Decision(Decision {
            key: decision.key,
            effects: decision.effects.into_iter().map(effect).collect(),
        })),
        Ok(types::Outcome::Skip(reason)) => Ok(Outcome::Skip {
            reason: printable(&reason, PLUGIN_TEXT_BYTES),
        }),
        Err(failure) => Err(Failure {
            kind: match failure.kind {
                types::FailureKind::InvalidInput => FailureKind::InvalidInput,
                types::FailureKind::Retryable => FailureKind::Retryable,
            },
            reason: printable(&failure.reason, PLUGIN_TEXT_BYTES),
        }),
    }
}

fn effect(effect: types::Effect) -> Effect {
    match effect {
        types::Effect::Exec(exec) => Effect::Exec {
            statement: exec.statement,
            params: exec.params.into_iter().map(value).collect(),
        },
        types::Effect::Outbox(outbox) => Effect::Outbox(OutboxMessage {
            destination: outbox.destination,
            payload: outbox.payload,
            headers: outbox.headers,
            key: outbox.key,
        }),
    }
}

fn value(value: types::Value) -> Value {
    match value {
        types::Value::Null => Value::Null,
        types::Value::Boolean(flag) => Value::Boolean(flag),
        types::Value::Integer(integer) => Value::Integer(integer),
        types::Value::Float(float) => Value::Float(float),
        types::Value::Text(text) => Value::Text(text),
        types::Value::Json(json) => Value::Json(json),
        types::Value::Bytes(bytes) => Value::Bytes(bytes),
        types::Value::Timestamp(micros) => Value::Timestamp(micros),
    }
}
