// The loyalty consumer from the guide, as an idem plugin in JavaScript (componentize-js).
//
// Same logic and reasons as plugins/loyalty (Rust); tests/conformance checks they agree.
// WIT s64 values are BigInt here. JSON numbers are parsed from their source text so that
// integers beyond 2^53 keep every digit, as in the Rust plugin.

const I64_MIN = -(2n ** 63n);
const I64_MAX = 2n ** 63n - 1n;


function fail(reason) {
  const error = new Error(reason);
  error.payload = { kind: "invalid-input", reason };
  throw error;
}

function jsonKind(value) {
  if (value === null) return "null";
  if (typeof value === "boolean") return "a boolean";
  if (typeof value === "object" && value.isNumber) return "a number";
  if (typeof value === "string") return "a string";
  if (Array.isArray(value)) return "an array";
  return "an object";
}

// JSON.parse, with every number kept as { isNumber, source } so big integers stay exact.
function parse(text) {
  return JSON.parse(text, (key, value, context) => {
    if (typeof value === "number") {
      const source = context && context.source !== undefined ? context.source : String(value);
      return { isNumber: true, source };
    }
    return value;
  });
}

function render(value) {
  if (value !== null && typeof value === "object" && value.isNumber) return value.source;
  return JSON.stringify(value, (key, inner) =>
    inner !== null && typeof inner === "object" && inner.isNumber ? Number(inner.source) : inner,
  );
}

function integerField(event, name) {
  const value = Object.prototype.hasOwnProperty.call(event, name) ? event[name] : null;
  if (value === null) fail(`missing field "${name}"`);
  if (!(typeof value === "object" && value.isNumber)) {
    fail(`field "${name}" must be an integer, got ${jsonKind(value)}`);
  }
  const integral = /^-?(0|[1-9][0-9]*)$/.test(value.source);
  const parsed = integral ? BigInt(value.source) : null;
  if (parsed === null || parsed < I64_MIN || parsed > I64_MAX) {
    fail(`field "${name}" must be an integer between -2^63 and 2^63-1`);
  }
  return parsed;
}

function exec(statement, params) {
  return { tag: "exec", val: { statement, params: params.map((val) => ({ tag: "integer", val })) } };
}

export const handler = {
  handle(message) {
    let event;
    try {
      const text = new TextDecoder("utf-8", { fatal: true }).decode(message.body);
      event = parse(text);
    } catch (error) {
      fail(`body is not valid JSON: ${error.message}`);
    }
    if (event === null || typeof event !== "object" || Array.isArray(event) || event.isNumber) {
      fail(`body must be a JSON object, got ${jsonKind(event)}`);
    }
    if (Object.prototype.hasOwnProperty.call(event, "type") && event.type !== "OrderCompleted") {
      return { tag: "skip", val: `event type ${render(event.type)} is not OrderCompleted` };
    }
    const orderId = integerField(event, "order_id");
    const customerId = integerField(event, "customer_id");
    const totalCents = integerField(event, "total_cents");
    if (totalCents < 0n) fail(`field "total_cents" must not be negative, got ${totalCents}`);
    const points = totalCents / 100n;
    return {
      tag: "decision",
      val: {
        key: `order-completed:${orderId}`,
        effects: [exec("credit_balance", [customerId, points]), exec("record_ledger", [customerId, orderId, points])],
      },
    };
  },
};
