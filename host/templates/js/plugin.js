// {{name}}: records each placed order once.
//
// Input: {"type": "OrderPlaced", "order_id": 9912, "customer_id": 7, "total_cents": 5000}
// (type may be left out). Key: order-placed:{order_id}, the same for every redelivery and
// replay of one order. Effect: the pipeline's record_order statement.

import { decision, exec, integerField, parseObject, render, skip, warmUp } from "./idem.js";

export const handler = {
  handle(message) {
    const event = parseObject(message.body);
    if (Object.prototype.hasOwnProperty.call(event, "type") && event.type !== "OrderPlaced") {
      return skip(`event type ${render(event.type)} is not OrderPlaced`);
    }
    const orderId = integerField(event, "order_id");
    const customerId = integerField(event, "customer_id");
    const totalCents = integerField(event, "total_cents");
    return decision(`order-placed:${orderId}`, exec("record_order", orderId, customerId, totalCents));
  },
};

// Every instance (a fresh one per message unless limits.messages_per_instance says otherwise)
// starts from the module as it stands after this line: run the handler on messages like the
// pipeline's, so a fresh instance does not compile it again (see warmUp in idem.js).
warmUp(handler, '{"type": "OrderPlaced", "order_id": 9912, "customer_id": 7, "total_cents": 5000}');
