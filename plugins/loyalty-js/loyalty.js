// The loyalty consumer from the guide, as an idem plugin in JavaScript (componentize-js).
//
// Same logic and reasons as plugins/loyalty (Rust); tests/conformance checks they agree.
// Field access and builders come from the JavaScript guest helper, plugins/idem-js/idem.js.

import {
  decision,
  exec,
  integerField,
  invalid,
  parseObject,
  render,
  skip,
  warmUp,
} from "../idem-js/idem.js";

export const handler = {
  handle(message) {
    const event = parseObject(message.body);
    if (Object.prototype.hasOwnProperty.call(event, "type") && event.type !== "OrderCompleted") {
      return skip(`event type ${render(event.type)} is not OrderCompleted`);
    }
    const orderId = integerField(event, "order_id");
    const customerId = integerField(event, "customer_id");
    const totalCents = integerField(event, "total_cents");
    if (totalCents < 0n) invalid(`field "total_cents" must not be negative, got ${totalCents}`);
    const points = totalCents / 100n;
    return decision(
      `order-completed:${orderId}`,
      exec("credit_balance", customerId, points),
      exec("record_ledger", customerId, orderId, points),
    );
  },
};

// Every instance starts from the module as it stands after this line (see warmUp in idem.js).
warmUp(handler, '{"order_id": 1, "customer_id": 1, "total_cents": 5000}');
