//! Sends a receipt for every completed order through the transactional outbox: the example
//! of the built-in `outbox` effect (the guide's Step 6).
//!
//! Input: an `OrderCompleted` event, `{"order_id": 9912, "customer_id": 7, "total_cents": 5000}`.
//! Key: `receipt:{order_id}`. Effects: `record_receipt` (a row in `receipts`, named in
//! `pipelines.toml`) and an outbox message to the destination `receipts`, written in the
//! same transaction; the relay delivers it with the key as its `Idempotency-Key`.

use idem_plugin::serde_json::json;
use idem_plugin::{Effect, Event, Failure, Guest, Message, Outbox, Outcome, decision, exec, params};

struct Receipts;

idem_plugin::export!(Receipts);

impl Guest for Receipts {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let event = Event::parse(&message.body)?;
        let order_id = event.integer("order_id")?;
        let customer_id = event.integer("customer_id")?;
        let total_cents = event.integer("total_cents")?;
        let receipt = json!({
            "type": "ReceiptIssued",
            "order_id": order_id,
            "customer_id": customer_id,
            "total_cents": total_cents,
        });
        let send = Effect::Outbox(Outbox {
            destination: "receipts".into(),
            payload: receipt.to_string().into_bytes(),
            headers: vec![("content-type".into(), "application/json".into())],
            // None: the decision's key, `receipt:{order_id}`.
            key: None,
        });
        Ok(decision(
            format!("receipt:{order_id}"),
            vec![exec("record_receipt", params![order_id, customer_id, total_cents]), send],
        ))
    }
}
