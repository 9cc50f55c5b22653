//! Write an idem plugin in Rust.
//!
//! ```ignore
//! use idem_plugin::{Event, Failure, Guest, Message, Outcome, decision, exec, params};
//!
//! struct Orders;
//! idem_plugin::export!(Orders);
//!
//! impl Guest for Orders {
//!     fn handle(message: Message) -> Result<Outcome, Failure> {
//!         let event = Event::parse(&message.body)?;
//!         let order_id = event.integer("order_id")?;
//!         let total_cents = event.integer("total_cents")?;
//!         Ok(decision(
//!             format!("order:{order_id}"),
//!             vec![exec("record_order", params![order_id, total_cents])],
//!         ))
//!     }
//! }
//! ```
//!
//! A failure's reason names the field and what was wrong (`missing field "order_id"`,
//! `field "total_cents" must be an integer, got a string`): it is what an operator reads in
//! the dead-letter queue, and what a case in `cases.json` matches.

wit_bindgen::generate!({
    path: "wit",
    world: "plugin",
    pub_export_macro: true,
    default_bindings_module: "idem_plugin",
});

pub use exports::idem::plugin::handler::Guest;
pub use idem::plugin::log::{Level, log};
pub use idem::plugin::types::{
    Decision, Effect, Exec, Failure, FailureKind, Message, Outbox, Outcome, Value,
};
pub use serde_json;

use serde_json::{Map, Value as Json};

/// A message body that is a JSON object, with typed access to its fields.
#[derive(Debug, Clone)]
pub struct Event(Map<String, Json>);

impl Event {
    /// Parses `body` as a JSON object; anything else is invalid input.
    pub fn parse(body: &[u8]) -> Result<Event, Failure> {
        match serde_json::from_slice::<Json>(body) {
            Ok(Json::Object(object)) => Ok(Event(object)),
            Ok(other) => Err(invalid(format!(
                "body must be a JSON object, got {}",
                json_kind(&other)
            ))),
            Err(error) => Err(invalid(format!("body is not valid JSON: {error}"))),
        }
    }

    /// A nested object field as an event of its own (`missing field` if absent or null).
    pub fn object(&self, name: &str) -> Result<Event, Failure> {
        match self.required(name)? {
            Json::Object(object) => Ok(Event(object.clone())),
            other => Err(wrong_type(name, "an object", other)),
        }
    }

    /// The field's raw JSON value; `None` when absent (a JSON `null` is `Some(Null)`).
    pub fn get(&self, name: &str) -> Option<&Json> {
        self.0.get(name)
    }

    /// Whether the field is present (even as `null`).
    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// An integer field between -2^63 and 2^63-1 (no fraction, no exponent).
    pub fn integer(&self, name: &str) -> Result<i64, Failure> {
        integer(name, self.required(name)?)
    }

    /// An integer field, or `None` when absent or null.
    pub fn optional_integer(&self, name: &str) -> Result<Option<i64>, Failure> {
        self.optional(name).map(|value| integer(name, value)).transpose()
    }

    /// A number field (integers accepted).
    pub fn float(&self, name: &str) -> Result<f64, Failure> {
        match self.required(name)? {
            Json::Number(number) => number
                .as_f64()
                .ok_or_else(|| invalid(format!("field \"{name}\" is not a finite number"))),
            other => Err(wrong_type(name, "a number", other)),
        }
    }

    /// A string field.
    pub fn text(&self, name: &str) -> Result<&str, Failure> {
        match self.required(name)? {
            Json::String(text) => Ok(text),
            other => Err(wrong_type(name, "a string", other)),
        }
    }

    /// A string field, or `None` when absent or null.
    pub fn optional_text(&self, name: &str) -> Result<Option<&str>, Failure> {
        match self.optional(name) {
            None => Ok(None),
            Some(Json::String(text)) => Ok(Some(text)),
            Some(other) => Err(wrong_type(name, "a string", other)),
        }
    }

    /// A boolean field.
    pub fn boolean(&self, name: &str) -> Result<bool, Failure> {
        match self.required(name)? {
            Json::Bool(flag) => Ok(*flag),
            other => Err(wrong_type(name, "a boolean", other)),
        }
    }

    /// The whole object.
    pub fn fields(&self) -> &Map<String, Json> {
        &self.0
    }

    fn required(&self, name: &str) -> Result<&Json, Failure> {
        self.optional(name)
            .ok_or_else(|| invalid(format!("missing field \"{name}\"")))
    }

    fn optional(&self, name: &str) -> Option<&Json> {
        self.0.get(name).filter(|value| !value.is_null())
    }
}

fn integer(name: &str, value: &Json) -> Result<i64, Failure> {
    match value {
        Json::Number(number) => number.as_i64().ok_or_else(|| {
            invalid(format!(
                "field \"{name}\" must be an integer between -2^63 and 2^63-1"
            ))
        }),
        other => Err(wrong_type(name, "an integer", other)),
    }
}

fn wrong_type(name: &str, expected: &str, got: &Json) -> Failure {
    invalid(format!(
        "field \"{name}\" must be {expected}, got {}",
        json_kind(got)
    ))
}

/// `null`, `a boolean`, `a number`, `a string`, `an array` or `an object`, for reasons.
pub fn json_kind(value: &Json) -> &'static str {
    match value {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// The message can never succeed: it is dead-lettered with `reason`.
pub fn invalid(reason: impl Into<String>) -> Failure {
    Failure {
        kind: FailureKind::InvalidInput,
        reason: reason.into(),
    }
}

/// Trying again later may succeed: the host retries it a bounded number of times.
pub fn retryable(reason: impl Into<String>) -> Failure {
    Failure {
        kind: FailureKind::Retryable,
        reason: reason.into(),
    }
}

/// Claim `key`, then apply `effects` in order, in one transaction.
pub fn decision(key: impl Into<String>, effects: Vec<Effect>) -> Outcome {
    Outcome::Decision(Decision {
        key: key.into(),
        effects,
    })
}

/// Not for this consumer: acked with no claim and no effect.
pub fn skip(reason: impl Into<String>) -> Outcome {
    Outcome::Skip(reason.into())
}

/// Run the pipeline's statement `statement` with `params` (`$1`, `$2`, … in order).
pub fn exec(statement: &str, params: Vec<Value>) -> Effect {
    Effect::Exec(Exec {
        statement: statement.to_string(),
        params,
    })
}

/// Send `payload` to the outbox destination `destination` after the commit; the destination
/// receives the decision's key as its idempotency key.
pub fn outbox(destination: &str, payload: impl Into<Vec<u8>>) -> Effect {
    Effect::Outbox(Outbox {
        destination: destination.to_string(),
        payload: payload.into(),
        headers: Vec::new(),
        key: None,
    })
}

/// Statement parameters from Rust values: `params![order_id, "text", 1.5, true, None::<i64>]`.
#[macro_export]
macro_rules! params {
    ($($value:expr),* $(,)?) => {
        vec![$($crate::Value::from($value)),*]
    };
}

impl From<i64> for Value {
    fn from(integer: i64) -> Value {
        Value::Integer(integer)
    }
}

impl From<i32> for Value {
    fn from(integer: i32) -> Value {
        Value::Integer(i64::from(integer))
    }
}

impl From<u32> for Value {
    fn from(integer: u32) -> Value {
        Value::Integer(i64::from(integer))
    }
}

impl From<f64> for Value {
    fn from(float: f64) -> Value {
        Value::Float(float)
    }
}

impl From<bool> for Value {
    fn from(flag: bool) -> Value {
        Value::Boolean(flag)
    }
}

impl From<&str> for Value {
    fn from(text: &str) -> Value {
        Value::Text(text.to_string())
    }
}

impl From<String> for Value {
    fn from(text: String) -> Value {
        Value::Text(text)
    }
}

impl From<&String> for Value {
    fn from(text: &String) -> Value {
        Value::Text(text.clone())
    }
}

/// A JSON document parameter (bind it to a `json` or `jsonb` column).
impl From<&Json> for Value {
    fn from(document: &Json) -> Value {
        Value::Json(document.to_string())
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(value: Option<T>) -> Value {
        value.map_or(Value::Null, Into::into)
    }
}

impl Value {
    /// A `timestamptz` parameter: microseconds since 1970-01-01T00:00:00Z.
    pub fn timestamp_micros(micros: i64) -> Value {
        Value::Timestamp(micros)
    }

    /// A `bytea` parameter.
    pub fn bytes(bytes: impl Into<Vec<u8>>) -> Value {
        Value::Bytes(bytes.into())
    }
}
