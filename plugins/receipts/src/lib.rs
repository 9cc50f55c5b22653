//! Sends a receipt for every completed order through the transactional outbox: the example
//! of the built-in `outbox` effect (the guide's Step 6).
//!
//! Input: an `OrderCompleted` event, `{"order_id": 9912, "customer_id": 7, "total_cents": 5000}`.
//! Key: `receipt:{order_id}`. Effects: `record_receipt` (a row in `receipts`, named in
//! `pipelines.toml`) and an outbox message to the destination `receipts`, written in the
//! same transaction; the relay delivers it with the key as its `Idempotency-Key`.

wit_bindgen::generate!({ path: "../../wit", world: "plugin" });

use exports::idem::plugin::handler::Guest;
use idem::plugin::types::{
    Decision, Effect, Exec, Failure, FailureKind, Message, Outbox, Outcome, Value,
};
use serde_json::{Map, Value as Json, json};

struct Receipts;

export!(Receipts);

impl Guest for Receipts {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let event = match serde_json::from_slice::<Json>(&message.body) {
            Ok(Json::Object(object)) => object,
            Ok(_) => return Err(invalid("body must be a JSON object".into())),
            Err(error) => return Err(invalid(format!("body is not valid JSON: {error}"))),
        };
        let order_id = integer_field(&event, "order_id")?;
        let customer_id = integer_field(&event, "customer_id")?;
        let total_cents = integer_field(&event, "total_cents")?;
        let receipt = json!({
            "type": "ReceiptIssued",
            "order_id": order_id,
            "customer_id": customer_id,
            "total_cents": total_cents,
        });
        Ok(Outcome::Decision(Decision {
            key: format!("receipt:{order_id}"),
            effects: vec![
                Effect::Exec(Exec {
                    statement: "record_receipt".into(),
                    params: vec![
                        Value::Integer(order_id),
                        Value::Integer(customer_id),
                        Value::Integer(total_cents),
                    ],
                }),
                Effect::Outbox(Outbox {
                    destination: "receipts".into(),
                    payload: receipt.to_string().into_bytes(),
                    headers: vec![("content-type".into(), "application/json".into())],
                    // None: the decision's key, `receipt:{order_id}`.
                    key: None,
                }),
            ],
        }))
    }
}

fn integer_field(event: &Map<String, Json>, name: &str) -> Result<i64, Failure> {
    match event.get(name) {
        None | Some(Json::Null) => Err(invalid(format!("missing field \"{name}\""))),
        Some(value) => value
            .as_i64()
            .ok_or_else(|| invalid(format!("field \"{name}\" must be an integer"))),
    }
}

fn invalid(reason: String) -> Failure {
    Failure { kind: FailureKind::InvalidInput, reason }
}
