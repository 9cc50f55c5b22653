"""{{name}}: records each placed order once.

Input: {"type": "OrderPlaced", "order_id": 9912, "customer_id": 7, "total_cents": 5000}
(type may be left out). Key: order-placed:{order_id}, the same for every redelivery and
replay of one order. Effect: the pipeline's record_order statement.
"""

import json

import idem
from wit_world import exports
from wit_world.imports.types import Message, Outcome


class Handler(exports.Handler):
    def handle(self, message: Message) -> Outcome:
        event = idem.parse_object(message.body)
        if "type" in event and event["type"] != "OrderPlaced":
            rendered = json.dumps(event["type"], ensure_ascii=False, separators=(",", ":"))
            return idem.skip(f"event type {rendered} is not OrderPlaced")
        order_id = idem.integer_field(event, "order_id")
        customer_id = idem.integer_field(event, "customer_id")
        total_cents = idem.integer_field(event, "total_cents")
        return idem.decision(
            f"order-placed:{order_id}",
            idem.exec("record_order", order_id, customer_id, total_cents),
        )


# Every instance (a fresh one per message unless limits.messages_per_instance says otherwise)
# starts from the module as it stands after this line: run the handler on messages like the
# pipeline's, so a fresh instance does not redo its first-call work (see idem.warm_up).
idem.warm_up(Handler, '{"type": "OrderPlaced", "order_id": 9912, "customer_id": 7, "total_cents": 5000}')
