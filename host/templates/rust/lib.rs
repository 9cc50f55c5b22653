//! {{name}}: records each placed order once.
//!
//! Input: `{"type": "OrderPlaced", "order_id": 9912, "customer_id": 7, "total_cents": 5000}`
//! (`type` may be left out). Key: `order-placed:{order_id}`, the same for every redelivery
//! and replay of one order. Effect: the pipeline's `record_order` statement.

use idem_plugin::{Event, Failure, Guest, Message, Outcome, decision, exec, params, skip};

struct Plugin;

idem_plugin::export!(Plugin);

impl Guest for Plugin {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let event = Event::parse(&message.body)?;
        if let Some(event_type) = event.get("type") {
            if event_type.as_str() != Some("OrderPlaced") {
                return Ok(skip(format!("event type {event_type} is not OrderPlaced")));
            }
        }
        let order_id = event.integer("order_id")?;
        let customer_id = event.integer("customer_id")?;
        let total_cents = event.integer("total_cents")?;
        Ok(decision(
            format!("order-placed:{order_id}"),
            vec![exec("record_order", params![order_id, customer_id, total_cents])],
        ))
    }
}
