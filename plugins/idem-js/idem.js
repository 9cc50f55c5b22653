// Write an idem plugin in JavaScript (componentize-js): JSON field access whose failures name
// the field, and builders for outcomes, effects and statement parameters.
//
//   import { parseObject, integerField, decision, exec } from "./idem.js";
//   export const handler = {
//     handle(message) {
//       const event = parseObject(message.body);
//       const orderId = integerField(event, "order_id");
//       return decision(`order:${orderId}`, exec("record_order", orderId));
//     },
//   };
//
// WIT s64 values are BigInt. JSON numbers are parsed from their source text, so integers
// beyond 2^53 keep every digit. A failure is thrown (`invalid(reason)`); its reason is what an
// operator reads in the dead-letter queue and what a case in cases.json matches.

import { log as hostLog } from "idem:plugin/log@0.3.0";

const WARM_UP_ROUNDS = 3;
let warmingUp = false;
const I64_MIN = -(2n ** 63n);
const I64_MAX = 2n ** 63n - 1n;

function failure(kind, reason) {
  const error = new Error(reason);
  error.payload = { kind, reason };
  return error;
}

/** The message can never succeed: it is dead-lettered with `reason`. Throws. */
export function invalid(reason) {
  throw failure("invalid-input", reason);
}

/** Trying again later may succeed: the host retries a bounded number of times. Throws. */
export function retryable(reason) {
  throw failure("retryable", reason);
}

/** A number as parsed by parseObject: its source text, exact. */
function isNumber(value) {
  return value !== null && typeof value === "object" && value.isNumber === true;
}

/** "null", "a boolean", "a number", "a string", "an array" or "an object", for reasons. */
export function jsonKind(value) {
  if (value === null || value === undefined) return "null";
  if (typeof value === "boolean") return "a boolean";
  if (isNumber(value) || typeof value === "number") return "a number";
  if (typeof value === "string") return "a string";
  if (Array.isArray(value)) return "an array";
  return "an object";
}

/** A parsed value as compact JSON text. */
export function render(value) {
  if (isNumber(value)) return value.source;
  return JSON.stringify(value, (key, inner) => (isNumber(inner) ? Number(inner.source) : inner));
}

/** The body (UTF-8 bytes) as a JSON object; anything else is invalid input. */
export function parseObject(body) {
  let event;
  try {
    const text = new TextDecoder("utf-8", { fatal: true }).decode(body);
    event = JSON.parse(text, (key, value, context) => {
      if (typeof value === "number") {
        const source = context && context.source !== undefined ? context.source : String(value);
        return { isNumber: true, source };
      }
      return value;
    });
  } catch (error) {
    invalid(`body is not valid JSON: ${error.message}`);
  }
  if (event === null || typeof event !== "object" || Array.isArray(event) || isNumber(event)) {
    invalid(`body must be a JSON object, got ${jsonKind(event)}`);
  }
  return event;
}

function present(event, name) {
  const value = Object.prototype.hasOwnProperty.call(event, name) ? event[name] : null;
  return value === undefined ? null : value;
}

function required(event, name) {
  const value = present(event, name);
  if (value === null) invalid(`missing field "${name}"`);
  return value;
}

function wrongType(name, expected, value) {
  invalid(`field "${name}" must be ${expected}, got ${jsonKind(value)}`);
}

/** An integer field between -2^63 and 2^63-1 (no fraction, no exponent), as a BigInt. */
export function integerField(event, name) {
  const value = required(event, name);
  if (!isNumber(value)) wrongType(name, "an integer", value);
  const integral = /^-?(0|[1-9][0-9]*)$/.test(value.source);
  const parsed = integral ? BigInt(value.source) : null;
  if (parsed === null || parsed < I64_MIN || parsed > I64_MAX) {
    invalid(`field "${name}" must be an integer between -2^63 and 2^63-1`);
  }
  return parsed;
}

/** An integer field, or null when absent or null. */
export function optionalIntegerField(event, name) {
  return present(event, name) === null ? null : integerField(event, name);
}

/** A number field (integers accepted), as a Number. */
export function floatField(event, name) {
  const value = required(event, name);
  if (!isNumber(value)) wrongType(name, "a number", value);
  return Number(value.source);
}

/** A string field. */
export function textField(event, name) {
  const value = required(event, name);
  if (typeof value !== "string") wrongType(name, "a string", value);
  return value;
}

/** A string field, or null when absent or null. */
export function optionalTextField(event, name) {
  return present(event, name) === null ? null : textField(event, name);
}

/** A boolean field. */
export function booleanField(event, name) {
  const value = required(event, name);
  if (typeof value !== "boolean") wrongType(name, "a boolean", value);
  return value;
}

/** A nested object field. */
export function objectField(event, name) {
  const value = required(event, name);
  if (typeof value !== "object" || Array.isArray(value) || isNumber(value)) {
    wrongType(name, "an object", value);
  }
  return value;
}

/** A parameter bound as a JSON document: exec("save", json({ a: 1 })). */
export function json(document) {
  return { tag: "json", val: render(document) };
}

/** A timestamptz parameter from a Date. */
export function timestamp(date) {
  return { tag: "timestamp", val: BigInt(date.getTime()) * 1000n };
}

/** A statement parameter from a JavaScript value. */
export function value(param) {
  if (param === null || param === undefined) return { tag: "null" };
  if (typeof param === "object" && typeof param.tag === "string") return param;
  if (typeof param === "bigint") return { tag: "integer", val: param };
  if (isNumber(param)) {
    return /^-?(0|[1-9][0-9]*)$/.test(param.source)
      ? { tag: "integer", val: BigInt(param.source) }
      : { tag: "float", val: Number(param.source) };
  }
  if (typeof param === "number") {
    return Number.isInteger(param) ? { tag: "integer", val: BigInt(param) } : { tag: "float", val: param };
  }
  if (typeof param === "boolean") return { tag: "boolean", val: param };
  if (typeof param === "string") return { tag: "text", val: param };
  if (param instanceof Uint8Array) return { tag: "bytes", val: param };
  if (param instanceof Date) return timestamp(param);
  return json(param);
}

/** Run the pipeline's statement `statement` with `params` ($1, $2, ... in order). */
export function exec(statement, ...params) {
  return { tag: "exec", val: { statement, params: params.map(value) } };
}

/** A string's UTF-8 bytes; bytes as they are. */
function bytesOf(text) {
  return typeof text === "string" ? new TextEncoder().encode(text) : text;
}

/** Send `payload` (a string or bytes) to an outbox destination after the commit. */
export function outbox(destination, payload, { key, headers = [] } = {}) {
  return { tag: "outbox", val: { destination, payload: bytesOf(payload), headers, key } };
}

/** Claim `key`, then apply `effects` in order, in one transaction. */
export function decision(key, ...effects) {
  return { tag: "decision", val: { key, effects } };
}

/** Not for this consumer: acked with no claim and no effect. */
export function skip(reason) {
  return { tag: "skip", val: reason };
}

/**
 * Log `message` through the host at `level` ("trace", "debug", "info", "warn" or "error"); at
 * most 32 lines per message reach the host's log. Dropped during `warmUp`, when the plugin is
 * being built and there is no host: a handler that calls the `idem:plugin/log` import itself
 * instead stops a warmed-up build with "You cannot call arbitrary imported functions during
 * Wizer initialization".
 */
export function log(level, message) {
  if (!warmingUp) hostLog(level, message);
}

/**
 * Run `handler` on sample message `bodies` (strings or bytes) while the plugin is built.
 *
 * Call it at module level, after the handler. componentize-js snapshots the module after it
 * has run, and every instance (a fresh one per message by default) starts from that snapshot:
 * with the handler's code paths already run, a fresh instance skips compiling them on its
 * first call. Every message still starts from the same state; what the warm-up leaves behind
 * is part of it, so use bodies like the messages the pipeline gets. Each body is run
 * `WARM_UP_ROUNDS` times. Failures the handler throws are expected and ignored; `log` calls
 * are dropped.
 */
export function warmUp(handler, ...bodies) {
  warmingUp = true;
  try {
    for (const body of Array(WARM_UP_ROUNDS).fill(bodies).flat()) {
      try {
        handler.handle({
          pipeline: "warm-up",
          source: "rabbitmq",
          queue: "warm-up",
          subject: "warm-up",
          body: bytesOf(body),
          headers: [],
          messageId: undefined,
          redelivered: false,
          deliveryCount: undefined,
          attributes: [],
        });
      } catch {
        // A sample the handler refuses still warms the paths it took.
      }
    }
  } finally {
    warmingUp = false;
  }
}
