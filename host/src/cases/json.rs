//! Outcomes, effects and values as JSON: what `idem try` prints and a case's `expect`
//! holds, and back (a case's effects and statement parameters read from JSON).

use chrono::{DateTime, SecondsFormat};
use serde_json::{Value as Json, json};

use crate::effect::{Effect, OutboxMessage, Outcome, Value};
use crate::sandbox::PluginError;

/// An outcome as JSON: what `idem try` prints and a case's `expect` holds.
pub fn outcome_json(actual: &Result<Outcome, PluginError>) -> Json {
    match actual {
        Ok(Outcome::Decision(decision)) => json!({
            "outcome": "decision",
            "key": decision.key,
            "effects": decision.effects.iter().map(effect_json).collect::<Vec<_>>(),
        }),
        Ok(Outcome::Skip { reason }) => json!({ "outcome": "skip", "reason": reason }),
        Err(PluginError::Rejected(failure)) => json!({
            "outcome": "failure",
            "kind": failure.kind.as_str(),
            "reason": failure.reason,
        }),
        Err(error) => json!({ "outcome": "error", "reason": error.to_string() }),
    }
}

/// `["statement", [params…]]` for an exec; `{"outbox": {…}}` for an outbox message.
pub fn effect_json(effect: &Effect) -> Json {
    match effect {
        Effect::Exec { statement, params } => {
            json!([statement, params.iter().map(value_json).collect::<Vec<_>>()])
        }
        Effect::Outbox(message) => json!({ "outbox": {
            "destination": message.destination,
            "payload": match std::str::from_utf8(&message.payload) {
                Ok(text) => json!(text),
                Err(_) => json!({ "bytes_hex": hex::encode(&message.payload) }),
            },
            "headers": message.headers.iter().map(|(name, value)| json!([name, value])).collect::<Vec<_>>(),
            "key": message.key,
        } }),
    }
}

pub(super) fn value_json(value: &Value) -> Json {
    match value {
        Value::Null => Json::Null,
        Value::Boolean(flag) => json!(flag),
        Value::Integer(integer) => json!(integer),
        Value::Float(float) if float.is_finite() => json!(float),
        Value::Float(float) => json!({ "float": float.to_string() }),
        Value::Text(text) => json!(text),
        Value::Json(text) => match serde_json::from_str::<Json>(text) {
            Ok(document) => json!({ "json": document }),
            Err(_) => json!({ "invalid_json": text }),
        },
        Value::Bytes(bytes) => json!({ "bytes_hex": hex::encode(bytes) }),
        Value::Timestamp(micros) => match DateTime::from_timestamp_micros(*micros) {
            Some(time) => json!({ "timestamp": time.to_rfc3339_opts(SecondsFormat::AutoSi, true) }),
            None => json!({ "timestamp": micros }),
        },
    }
}

/// An effect written in a case (or printed by `idem try`) as host data.
pub(super) fn parse_effect(effect: &Json) -> Result<Effect, String> {
    if let Some([statement, params]) = effect.as_array().map(Vec::as_slice) {
        let statement = statement
            .as_str()
            .ok_or("an exec is [\"statement\", [params…]]: the statement name must be a string")?;
        let params = params
            .as_array()
            .ok_or("an exec is [\"statement\", [params…]]: the parameters must be a list")?;
        let params = params
            .iter()
            .enumerate()
            .map(|(position, param)| {
                parse_value(param).map_err(|problem| format!("${}: {problem}", position + 1))
            })
            .collect::<Result<_, _>>()?;
        return Ok(Effect::Exec {
            statement: statement.to_string(),
            params,
        });
    }
    if let Some(outbox) = effect.get("outbox") {
        let text = |field: &str| outbox.get(field).and_then(Json::as_str).map(str::to_string);
        let destination = text("destination").ok_or("outbox.destination must be a string")?;
        let payload = match outbox.get("payload") {
            Some(Json::String(text)) => text.clone().into_bytes(),
            Some(Json::Object(tagged)) if tagged.len() == 1 && tagged.contains_key("bytes_hex") => {
                decode_hex(tagged["bytes_hex"].as_str().unwrap_or_default())?
            }
            _ => return Err("outbox.payload must be a string or {\"bytes_hex\": \"…\"}".into()),
        };
        let headers = match outbox.get("headers") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(pairs)) => pairs
                .iter()
                .map(|pair| match pair.as_array().map(Vec::as_slice) {
                    Some([Json::String(name), Json::String(value)]) => {
                        Ok((name.clone(), value.clone()))
                    }
                    _ => Err("outbox.headers holds [\"name\", \"value\"] pairs".to_string()),
                })
                .collect::<Result<_, _>>()?,
            Some(Json::Object(map)) => map
                .iter()
                .map(|(name, value)| match value {
                    Json::String(value) => Ok((name.clone(), value.clone())),
                    _ => Err(format!("outbox.headers.{name} must be a string")),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err("outbox.headers holds [\"name\", \"value\"] pairs".into()),
        };
        return Ok(Effect::Outbox(OutboxMessage {
            destination,
            payload,
            headers,
            key: text("key"),
        }));
    }
    Err(format!(
        "an effect is [\"statement\", [params…]] or {{\"outbox\": {{\"destination\": …, \"payload\": …}}}}, not {effect}"
    ))
}

pub(super) fn parse_value(param: &Json) -> Result<Value, String> {
    const FORMS: &str = "a parameter is null, true/false, a number, a string, or {\"json\": …}, {\"bytes_hex\": \"…\"}, {\"timestamp\": \"2026-12-04T10:00:00Z\"}";
    Ok(match param {
        Json::Null => Value::Null,
        Json::Bool(flag) => Value::Boolean(*flag),
        Json::Number(number) => match (number.as_i64(), number.as_f64()) {
            (Some(integer), _) => Value::Integer(integer),
            (None, Some(_)) if number.is_u64() => {
                return Err(format!("{number} is past the largest integer, 2^63-1"));
            }
            (None, Some(float)) => Value::Float(float),
            (None, None) => return Err(format!("{number} is not a number idem can carry")),
        },
        Json::String(text) => Value::Text(text.clone()),
        Json::Object(tagged) if tagged.len() == 1 => {
            let (tag, inner) = tagged.iter().next().expect("one entry");
            match (tag.as_str(), inner) {
                ("json", document) => Value::Json(document.to_string()),
                ("invalid_json", Json::String(text)) => Value::Json(text.clone()),
                ("bytes_hex", Json::String(hex)) => Value::Bytes(decode_hex(hex)?),
                ("timestamp", Json::String(time)) => Value::Timestamp(
                    DateTime::parse_from_rfc3339(time)
                        .map_err(|error| {
                            format!(
                                "timestamp {time:?}: {error} (RFC 3339, e.g. 2026-12-04T10:00:00Z)"
                            )
                        })?
                        .timestamp_micros(),
                ),
                ("timestamp", Json::Number(micros)) => {
                    Value::Timestamp(micros.as_i64().ok_or_else(|| {
                        format!("timestamp {micros}: whole microseconds since the epoch")
                    })?)
                }
                ("float", Json::String(special)) => Value::Float(
                    special
                        .parse()
                        .map_err(|_| format!("float {special:?} is not a number"))?,
                ),
                ("float", Json::Number(number)) => {
                    Value::Float(number.as_f64().unwrap_or(f64::NAN))
                }
                ("integer", Json::Number(number)) => Value::Integer(
                    number
                        .as_i64()
                        .ok_or_else(|| format!("integer {number} is out of range"))?,
                ),
                ("text", Json::String(text)) => Value::Text(text.clone()),
                ("boolean", Json::Bool(flag)) => Value::Boolean(*flag),
                ("null", Json::Null) => Value::Null,
                _ => return Err(format!("{param} is not a parameter: {FORMS}")),
            }
        }
        _ => return Err(format!("{param} is not a parameter: {FORMS}")),
    })
}

pub(super) fn decode_hex(text: &str) -> Result<Vec<u8>, String> {
    let digits: String = text
        .chars()
        .filter(|character| !character.is_whitespace())
        .collect();
    hex::decode(&digits).map_err(|error| format!("{text:?} is not hex: {error}"))
}
