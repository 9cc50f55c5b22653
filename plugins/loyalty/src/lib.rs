//! The loyalty consumer from the guide, as an idem plugin.
//!
//! Input: an `OrderCompleted` event, `{"order_id": 9912, "customer_id": 7, "total_cents": 5000}`.
//! Key: `order-completed:{order_id}`, so every redelivery or replay of one order is one claim.
//! Effects: credit `total_cents / 100` points to the customer's balance and write one ledger row.
//! The statements `credit_balance` and `record_ledger` are named in `pipelines.toml`.

use idem_plugin::{Event, Failure, Guest, Message, Outcome, decision, exec, invalid, params, skip};

/// Points per 100 cents. The `double-points` build (`plugins/loyalty-bonus`) credits twice as
/// much, so the hot-swap tests can tell which build applied an order.
const POINTS_PER_100_CENTS: i64 = if cfg!(feature = "double-points") { 2 } else { 1 };

struct Loyalty;

idem_plugin::export!(Loyalty);

impl Guest for Loyalty {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let event = Event::parse(&message.body)?;
        if let Some(event_type) = event.get("type") {
            if event_type.as_str() != Some("OrderCompleted") {
                return Ok(skip(format!("event type {event_type} is not OrderCompleted")));
            }
        }
        let order_id = event.integer("order_id")?;
        let customer_id = event.integer("customer_id")?;
        let total_cents = event.integer("total_cents")?;
        if total_cents < 0 {
            return Err(invalid(format!(
                "field \"total_cents\" must not be negative, got {total_cents}"
            )));
        }
        let points = total_cents / 100 * POINTS_PER_100_CENTS;
        Ok(decision(
            format!("order-completed:{order_id}"),
            vec![
                exec("credit_balance", params![customer_id, points]),
                exec("record_ledger", params![customer_id, order_id, points]),
            ],
        ))
    }
}
