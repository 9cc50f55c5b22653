"""The loyalty consumer from the guide, as an idem plugin in Python (componentize-py).

Same logic and reasons as plugins/loyalty (Rust); tests/conformance checks they agree.
Input: an OrderCompleted event {"order_id": 9912, "customer_id": 7, "total_cents": 5000}.
Key: order-completed:{order_id}. Effects: credit total_cents // 100 points, write a ledger row.
"""

import json

import idem
from wit_world import exports
from wit_world.imports.types import Message, Outcome


class Handler(exports.Handler):
    def handle(self, message: Message) -> Outcome:
        event = idem.parse_object(message.body)
        if "type" in event and event["type"] != "OrderCompleted":
            rendered = json.dumps(event["type"], ensure_ascii=False, separators=(",", ":"))
            return idem.skip(f"event type {rendered} is not OrderCompleted")
        order_id = idem.integer_field(event, "order_id")
        customer_id = idem.integer_field(event, "customer_id")
        total_cents = idem.integer_field(event, "total_cents")
        if total_cents < 0:
            raise idem.invalid(f'field "total_cents" must not be negative, got {total_cents}')
        points = total_cents // 100
        return idem.decision(
            f"order-completed:{order_id}",
            idem.exec("credit_balance", customer_id, points),
            idem.exec("record_ledger", customer_id, order_id, points),
        )


# Every instance starts from the module as it stands after this line (see idem.warm_up).
idem.warm_up(Handler, '{"order_id": 1, "customer_id": 1, "total_cents": 5000}')
