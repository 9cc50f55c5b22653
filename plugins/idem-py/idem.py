"""Write an idem plugin in Python (componentize-py): JSON field access whose failures name the
field, and builders for outcomes, effects and statement parameters.

    import idem

    class Handler(exports.Handler):
        def handle(self, message):
            event = idem.parse_object(message.body)
            order_id = idem.integer_field(event, "order_id")
            return idem.decision(f"order:{order_id}", idem.exec("record_order", order_id))

A failure is raised (``raise idem.invalid("...")``); its reason is what an operator reads in
the dead-letter queue and what a case in cases.json matches.
"""

import json

from componentize_py_types import Err
from wit_world.imports import log as _log
from wit_world.imports.types import (
    Decision,
    Effect_Exec,
    Effect_Outbox,
    Exec,
    Failure,
    FailureKind,
    Message,
    Outbox,
    Outcome_Decision,
    Outcome_Skip,
    Value_Boolean,
    Value_Bytes,
    Value_Float,
    Value_Integer,
    Value_Json,
    Value_Null,
    Value_Text,
    Value_Timestamp,
)

WARM_UP_ROUNDS = 3
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


def invalid(reason: str) -> Err:
    """The message can never succeed: it is dead-lettered with ``reason``. Raise it."""
    return Err(Failure(kind=FailureKind.INVALID_INPUT, reason=reason))


def retryable(reason: str) -> Err:
    """Trying again later may succeed: the host retries a bounded number of times. Raise it."""
    return Err(Failure(kind=FailureKind.RETRYABLE, reason=reason))


def json_kind(value) -> str:
    """'null', 'a boolean', 'a number', 'a string', 'an array' or 'an object', for reasons."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_object(body: bytes) -> dict:
    """The body as a JSON object (NaN and Infinity refused); anything else is invalid input."""
    try:
        event = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as error:
        raise invalid(f"body is not valid JSON: {error}")
    if not isinstance(event, dict):
        raise invalid(f"body must be a JSON object, got {json_kind(event)}")
    return event


def _required(event: dict, name: str):
    value = event.get(name)
    if value is None:
        raise invalid(f'missing field "{name}"')
    return value


def _wrong_type(name: str, expected: str, value) -> Err:
    return invalid(f'field "{name}" must be {expected}, got {json_kind(value)}')


def integer_field(event: dict, name: str) -> int:
    """An integer field between -2^63 and 2^63-1 (no fraction, no exponent)."""
    value = _required(event, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, "an integer", value)
    if isinstance(value, float) or not I64_MIN <= value <= I64_MAX:
        raise invalid(f'field "{name}" must be an integer between -2^63 and 2^63-1')
    return value


def optional_integer_field(event: dict, name: str):
    """An integer field, or None when absent or null."""
    return None if event.get(name) is None else integer_field(event, name)


def float_field(event: dict, name: str) -> float:
    """A number field (integers accepted)."""
    value = _required(event, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, "a number", value)
    return float(value)


def text_field(event: dict, name: str) -> str:
    """A string field."""
    value = _required(event, name)
    if not isinstance(value, str):
        raise _wrong_type(name, "a string", value)
    return value


def optional_text_field(event: dict, name: str):
    """A string field, or None when absent or null."""
    return None if event.get(name) is None else text_field(event, name)


def boolean_field(event: dict, name: str) -> bool:
    """A boolean field."""
    value = _required(event, name)
    if not isinstance(value, bool):
        raise _wrong_type(name, "a boolean", value)
    return value


def object_field(event: dict, name: str) -> dict:
    """A nested object field."""
    value = _required(event, name)
    if not isinstance(value, dict):
        raise _wrong_type(name, "an object", value)
    return value


class Json:
    """A parameter bound as a JSON document: ``idem.exec("save", idem.Json({"a": 1}))``."""

    def __init__(self, document):
        self.document = document


class Timestamp:
    """A timestamptz parameter, in microseconds since 1970-01-01T00:00:00Z."""

    def __init__(self, micros: int):
        self.micros = micros


def value(param):
    """A statement parameter from a Python value: None, bool, int, float, str, bytes,
    ``Json(...)`` or ``Timestamp(...)``."""
    if param is None:
        return Value_Null()
    if isinstance(param, bool):
        return Value_Boolean(param)
    if isinstance(param, int):
        if not I64_MIN <= param <= I64_MAX:
            raise ValueError(f"parameter {param} does not fit in 64 bits")
        return Value_Integer(param)
    if isinstance(param, float):
        return Value_Float(param)
    if isinstance(param, str):
        return Value_Text(param)
    if isinstance(param, (bytes, bytearray)):
        return Value_Bytes(bytes(param))
    if isinstance(param, Json):
        return Value_Json(json.dumps(param.document, separators=(",", ":")))
    if isinstance(param, Timestamp):
        return Value_Timestamp(param.micros)
    raise TypeError(f"cannot pass {type(param).__name__} as a statement parameter")


def exec(statement: str, *params):
    """Run the pipeline's statement ``statement`` with ``params`` ($1, $2, ... in order)."""
    return Effect_Exec(Exec(statement=statement, params=[value(param) for param in params]))


def _bytes_of(text) -> bytes:
    """A str's UTF-8 bytes; bytes as they are."""
    return text.encode("utf-8") if isinstance(text, str) else text


def outbox(destination: str, payload, key=None, headers=()):
    """Send ``payload`` (bytes or str) to an outbox destination after the commit."""
    return Effect_Outbox(
        Outbox(
            destination=destination,
            payload=_bytes_of(payload),
            headers=list(headers),
            key=key,
        )
    )


def decision(key: str, *effects):
    """Claim ``key``, then apply ``effects`` in order, in one transaction."""
    return Outcome_Decision(Decision(key=key, effects=list(effects)))


def skip(reason: str):
    """Not for this consumer: acked with no claim and no effect."""
    return Outcome_Skip(reason)


def warm_up(handler_class, *bodies):
    """Run the handler on sample message ``bodies`` (bytes or str) while the plugin is built.

    Call it at module level, after the handler class. componentize-py snapshots the module as
    it stands after import, and every instance (a fresh one per message by default) starts from
    that snapshot: with the handler's code paths already run, a fresh instance skips the work
    its first call would do (Python specialises bytecode, fills caches and allocates on first
    use). Every message still starts from the same state; what the warm-up leaves behind is
    part of it, so use bodies like the messages the pipeline gets. Each body is run
    ``WARM_UP_ROUNDS`` times (the interpreter specialises code that has run more than once).
    Failures the handler raises are expected and ignored; ``log`` calls are dropped (the host
    is not there at build time).
    """
    handler = handler_class()
    real_log = _log.log
    _log.log = lambda level, message: None
    try:
        for body in bodies * WARM_UP_ROUNDS:
            try:
                handler.handle(
                    Message(
                        pipeline="warm-up",
                        source="rabbitmq",
                        queue="warm-up",
                        subject="warm-up",
                        body=_bytes_of(body),
                        headers=[],
                        message_id=None,
                        redelivered=False,
                        delivery_count=None,
                        attributes=[],
                    )
                )
            except Exception:
                pass
    finally:
        _log.log = real_log
