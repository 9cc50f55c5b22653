//! The loyalty consumer from the guide, as an idem plugin.
//!
//! Input: an `OrderCompleted` event, `{"order_id": 9912, "customer_id": 7, "total_cents": 5000}`.
//! Key: `order-completed:{order_id}`, so every redelivery or replay of one order is one claim.
//! Effects: credit `total_cents / 100` points to the customer's balance and write one ledger row.
//! The statements `credit_balance` and `record_ledger` are named in `pipelines.toml`.

wit_bindgen::generate!({ path: "../../wit", world: "plugin" });

use exports::idem::plugin::handler::Guest;
use idem::plugin::types::{
    Decision, Effect, Exec, Failure, FailureKind, Message, Outcome, Value,
};
use serde_json::{Map, Value as Json};

/// Points per 100 cents. The `double-points` build (`plugins/loyalty-bonus`) credits twice as
/// much, so the hot-swap tests can tell which build applied an order.
const POINTS_PER_100_CENTS: i64 = if cfg!(feature = "double-points") { 2 } else { 1 };

struct Loyalty;

export!(Loyalty);

impl Guest for Loyalty {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let event = parse_object(&message.body)?;
        if let Some(event_type) = event.get("type") {
            if event_type.as_str() != Some("OrderCompleted") {
                return Ok(Outcome::Skip(format!(
                    "event type {event_type} is not OrderCompleted"
                )));
            }
        }
        let order_id = integer_field(&event, "order_id")?;
        let customer_id = integer_field(&event, "customer_id")?;
        let total_cents = integer_field(&event, "total_cents")?;
        if total_cents < 0 {
            return Err(invalid(format!(
                "field \"total_cents\" must not be negative, got {total_cents}"
            )));
        }
        let points = total_cents / 100 * POINTS_PER_100_CENTS;
        Ok(Outcome::Decision(Decision {
            key: format!("order-completed:{order_id}"),
            effects: vec![
                exec("credit_balance", vec![Value::Integer(customer_id), Value::Integer(points)]),
                exec(
                    "record_ledger",
                    vec![
                        Value::Integer(customer_id),
                        Value::Integer(order_id),
                        Value::Integer(points),
                    ],
                ),
            ],
        }))
    }
}

fn parse_object(body: &[u8]) -> Result<Map<String, Json>, Failure> {
    match serde_json::from_slice::<Json>(body) {
        Ok(Json::Object(object)) => Ok(object),
        Ok(other) => Err(invalid(format!(
            "body must be a JSON object, got {}",
            json_kind(&other)
        ))),
        Err(error) => Err(invalid(format!("body is not valid JSON: {error}"))),
    }
}

fn integer_field(event: &Map<String, Json>, name: &str) -> Result<i64, Failure> {
    match event.get(name) {
        None | Some(Json::Null) => Err(invalid(format!("missing field \"{name}\""))),
        Some(Json::Number(number)) => number.as_i64().ok_or_else(|| {
            invalid(format!(
                "field \"{name}\" must be an integer between -2^63 and 2^63-1"
            ))
        }),
        Some(other) => Err(invalid(format!(
            "field \"{name}\" must be an integer, got {}",
            json_kind(other)
        ))),
    }
}

fn json_kind(value: &Json) -> &'static str {
    match value {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

fn exec(statement: &str, params: Vec<Value>) -> Effect {
    Effect::Exec(Exec { statement: statement.to_string(), params })
}

fn invalid(reason: String) -> Failure {
    Failure { kind: FailureKind::InvalidInput, reason }
}
