//! A plugin for the host's tests: the message body says what it should do.
//!
//! `{"action": "trap"}` panics (a trap), `"loop"` never returns, `"alloc"` grows memory
//! without bound, `"alloc-1g"` asks for 1 GiB at once, `"retry"` and `"invalid"` return failures, `"skip"` skips, `"log"` logs,
//! `"count"` skips with the number of calls this instance has served (`"call 3"`),
//! `"describe"` skips with the delivery's properties
//! (`pipeline=… source=… queue=… subject=… message_id=… redelivered=… delivery_count=…
//! headers=[a=b] attributes=[exchange=,routing-key=…]`),
//! and `"echo"` returns `{"key": …, "effects": [{"statement": …, "params": [...]}]}` as given
//! (JSON integers become `integer`, strings `text`, floats `float`, booleans `boolean`,
//! `null` `null`; `{"json": …}` becomes `json`, `{"timestamp": micros}` `timestamp`).

wit_bindgen::generate!({ path: "../../wit", world: "plugin" });

use exports::idem::plugin::handler::Guest;
use idem::plugin::log::{log, Level};
use idem::plugin::types::{
    Decision, Effect, Exec, Failure, FailureKind, Message, Outcome, Value,
};
use serde_json::Value as Json;
use std::sync::atomic::{AtomicU32, Ordering};

struct Chaos;

/// Calls this instance has served: 1 on every call when each message gets a fresh instance.
static CALLS: AtomicU32 = AtomicU32::new(0);

export!(Chaos);

impl Guest for Chaos {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let request: Json = serde_json::from_slice(&message.body)
            .map_err(|error| failure(FailureKind::InvalidInput, format!("not JSON: {error}")))?;
        match request["action"].as_str().unwrap_or("echo") {
            "trap" => panic!("chaos plugin asked to trap"),
            "loop" => {
                let mut counter: u64 = 0;
                loop {
                    counter = std::hint::black_box(counter.wrapping_add(1));
                }
            }
            "alloc" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 16 * 1024 * 1024]);
                    std::hint::black_box(&hoard);
                }
            }
            "alloc-1g" => {
                let gigabyte = vec![1u8; 1 << 30];
                std::hint::black_box(&gigabyte);
                Ok(Outcome::Skip("allocated 1 GiB".into()))
            }
            "retry" => Err(failure(FailureKind::Retryable, "chaos plugin asked to retry".into())),
            "invalid" => Err(failure(FailureKind::InvalidInput, "chaos plugin asked to fail".into())),
            "skip" => Ok(Outcome::Skip("chaos plugin asked to skip".into())),
            "count" => {
                let calls = CALLS.fetch_add(1, Ordering::Relaxed) + 1;
                Ok(Outcome::Skip(format!("call {calls}")))
            }
            "describe" => Ok(Outcome::Skip(format!(
                "pipeline={} source={} queue={} subject={} message_id={} redelivered={} delivery_count={} headers=[{}] attributes=[{}]",
                message.pipeline,
                message.source,
                message.queue,
                message.subject,
                message.message_id.as_deref().unwrap_or("-"),
                message.redelivered,
                message
                    .delivery_count
                    .map_or("-".to_string(), |count| count.to_string()),
                pairs(&message.headers),
                pairs(&message.attributes),
            ))),
            "log" => {
                log(Level::Info, "chaos plugin says hello");
                Ok(Outcome::Skip("logged".into()))
            }
            _ => echo(&request),
        }
    }
}

fn echo(request: &Json) -> Result<Outcome, Failure> {
    let key = request["key"]
        .as_str()
        .ok_or_else(|| failure(FailureKind::InvalidInput, "missing \"key\"".into()))?;
    let effects = request["effects"]
        .as_array()
        .map(|effects| effects.iter().map(effect).collect())
        .unwrap_or_default();
    Ok(Outcome::Decision(Decision { key: key.to_string(), effects }))
}

fn effect(request: &Json) -> Effect {
    Effect::Exec(Exec {
        statement: request["statement"].as_str().unwrap_or_default().to_string(),
        params: request["params"]
            .as_array()
            .map(|params| params.iter().map(value).collect())
            .unwrap_or_default(),
    })
}

fn value(json: &Json) -> Value {
    match json {
        Json::Null => Value::Null,
        Json::Bool(flag) => Value::Boolean(*flag),
        Json::Number(number) => match number.as_i64() {
            Some(integer) => Value::Integer(integer),
            None => Value::Float(number.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(text) => Value::Text(text.clone()),
        Json::Object(object) => match object.get("timestamp").and_then(Json::as_i64) {
            Some(micros) => Value::Timestamp(micros),
            None => Value::Json(object.get("json").map(Json::to_string).unwrap_or_default()),
        },
        Json::Array(_) => Value::Null,
    }
}

fn failure(kind: FailureKind, reason: String) -> Failure {
    Failure { kind, reason }
}

/// `a=b,c=d`.
fn pairs(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join(",")
}
