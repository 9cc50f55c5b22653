//! The generated WIT bindings of every contract the host runs, and their conversion to host
//! types. No other file names them.
//!
//! A plugin built for an older contract runs adapted to the current one: its message is made
//! from the current message (what the older record named is still known, under other names),
//! and what it returns converts to the same host types.

use wasmtime::Store;
use wasmtime::component::{InstancePre, Linker};

use crate::effect::{Decision, Effect, Failure, FailureKind, OutboxMessage, Outcome, Value};
use crate::message::InboundMessage;
use crate::sandbox::contract;
use crate::sandbox::state::PluginState;
use crate::sandbox::{PLUGIN_TEXT_BYTES, printable};

/// The contract these bindings were generated from, as `wit/world.wit` holds it: what
/// `idem wit` hands to plugin authors, so a plugin builds against exactly this host's WIT.
pub const WORLD_WIT: &str = include_str!("../../../wit/world.wit");

/// For the bindings in scope: the `log` import, and a call of the handler on the message
/// their `message` makes with what it returns in host types. The log interface and the
/// decision, effect and failure types are the same in every contract so far, so one body
/// serves them all.
macro_rules! handler_calls {
    () => {
        impl log::Host for PluginState {
            fn log(&mut self, level: log::Level, message: String) {
                let level = match level {
                    log::Level::Trace => tracing::Level::TRACE,
                    log::Level::Debug => tracing::Level::DEBUG,
                    log::Level::Info => tracing::Level::INFO,
                    log::Level::Warn => tracing::Level::WARN,
                    log::Level::Error => tracing::Level::ERROR,
                };
                self.plugin_log(level, &message);
            }
        }

        pub async fn handle(
            plugin: &Plugin,
            store: &mut Store<PluginState>,
            inbound: &InboundMessage,
        ) -> wasmtime::Result<Result<Outcome, Failure>> {
            let returned = plugin
                .idem_plugin_handler()
                .call_handle(store, &message(inbound))
                .await?;
            Ok(verdict(returned))
        }

        fn verdict(result: Result<types::Outcome, types::Failure>) -> Result<Outcome, Failure> {
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
    };
}

/// `idem:plugin@0.3.0`, the current contract (`wit/world.wit`).
mod current {
    use super::*;

    wasmtime::component::bindgen!({
        path: "../wit",
        world: "plugin",
        exports: { default: async },
    });

    use idem::plugin::{log, types};

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

    handler_calls!();
}

/// `idem:plugin@0.2.0` (`host/contracts/0.2.0`), deprecated: its message had the RabbitMQ
/// `routing-key` and `exchange` and nothing of other sources.
mod v0_2_0 {
    use super::*;

    wasmtime::component::bindgen!({
        path: "contracts/0.2.0",
        world: "plugin",
        exports: { default: async },
    });

    use idem::plugin::{log, types};

    /// The 0.2.0 message: the routing key is RabbitMQ's (the subject for a source without
    /// one, a JetStream subject being the nearest thing), the exchange RabbitMQ's (empty
    /// for the default exchange and for other sources).
    pub fn message(inbound: &InboundMessage) -> types::Message {
        types::Message {
            pipeline: inbound.pipeline.clone(),
            body: inbound.body.clone(),
            headers: inbound.headers.clone(),
            routing_key: inbound
                .attribute("routing-key")
                .unwrap_or(&inbound.subject)
                .to_string(),
            exchange: inbound
                .attribute("exchange")
                .unwrap_or_default()
                .to_string(),
            message_id: inbound.message_id.clone(),
            redelivered: inbound.redelivered,
        }
    }

    handler_calls!();
}

/// Defines the `log` import of every contract the host runs in `linker`.
pub fn add_to_linker(linker: &mut Linker<PluginState>) -> wasmtime::Result<()> {
    current::idem::plugin::log::add_to_linker::<_, wasmtime::component::HasSelf<_>>(
        linker,
        |state| state,
    )?;
    v0_2_0::idem::plugin::log::add_to_linker::<_, wasmtime::component::HasSelf<_>>(
        linker,
        |state| state,
    )
}

/// A type-checked component of one of the contracts, ready to instantiate per message.
pub enum PluginPre {
    Current(current::PluginPre<PluginState>),
    V0_2_0(v0_2_0::PluginPre<PluginState>),
}

/// An instance of a plugin, of its contract.
pub enum Plugin {
    Current(current::Plugin),
    V0_2_0(v0_2_0::Plugin),
}

impl PluginPre {
    /// Checks `instance_pre` against the world of contract `version` (the current one for
    /// any other).
    pub fn new(version: &str, instance_pre: InstancePre<PluginState>) -> wasmtime::Result<Self> {
        Ok(if version == contract::V0_2_0 {
            PluginPre::V0_2_0(v0_2_0::PluginPre::new(instance_pre)?)
        } else {
            PluginPre::Current(current::PluginPre::new(instance_pre)?)
        })
    }

    pub async fn instantiate_async(
        &self,
        store: &mut Store<PluginState>,
    ) -> wasmtime::Result<Plugin> {
        Ok(match self {
            PluginPre::Current(pre) => Plugin::Current(pre.instantiate_async(store).await?),
            PluginPre::V0_2_0(pre) => Plugin::V0_2_0(pre.instantiate_async(store).await?),
        })
    }
}

impl Plugin {
    /// The plugin's handler on `inbound`: its verdict in host types, or the trap.
    pub async fn handle(
        &self,
        store: &mut Store<PluginState>,
        inbound: &InboundMessage,
    ) -> wasmtime::Result<Result<Outcome, Failure>> {
        match self {
            Plugin::Current(plugin) => current::handle(plugin, store, inbound).await,
            Plugin::V0_2_0(plugin) => v0_2_0::handle(plugin, store, inbound).await,
        }
    }
}
