"""The loyalty consumer from the guide, as an idem plugin in Python (componentize-py).

Same logic and reasons as plugins/loyalty (Rust); tests/conformance checks they agree.
Input: an OrderCompleted event {"order_id": 9912, "customer_id": 7, "total_cents": 5000}.
Key: order-completed:{order_id}. Effects: credit total_cents // 100 points, write a ledger row.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports.types import (
    Decision,
    Effect_Exec,
    Exec,
    Failure,
    FailureKind,
    Message,
    Outcome,
    Outcome_Decision,
    Outcome_Skip,
    Value_Integer,
)

I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


def invalid(reason: str) -> Err:
    return Err(Failure(kind=FailureKind.INVALID_INPUT, reason=reason))


def reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def json_kind(value) -> str:
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


def integer_field(event: dict, name: str) -> int:
    value = event.get(name)
    if value is None:
        raise invalid(f'missing field "{name}"')
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f'field "{name}" must be an integer, got {json_kind(value)}')
    if isinstance(value, float) or not I64_MIN <= value <= I64_MAX:
        raise invalid(f'field "{name}" must be an integer between -2^63 and 2^63-1')
    return value


class Handler(exports.Handler):
    def handle(self, message: Message) -> Outcome:
        try:
            event = json.loads(message.body.decode("utf-8"), parse_constant=reject_constant)
        except (UnicodeDecodeError, ValueError) as error:
            raise invalid(f"body is not valid JSON: {error}")
        if not isinstance(event, dict):
            raise invalid(f"body must be a JSON object, got {json_kind(event)}")
        if "type" in event and event["type"] != "OrderCompleted":
            rendered = json.dumps(event["type"], ensure_ascii=False, separators=(",", ":"))
            return Outcome_Skip(f"event type {rendered} is not OrderCompleted")
        order_id = integer_field(event, "order_id")
        customer_id = integer_field(event, "customer_id")
        total_cents = integer_field(event, "total_cents")
        if total_cents < 0:
            raise invalid(f'field "total_cents" must not be negative, got {total_cents}')
        points = total_cents // 100
        return Outcome_Decision(
            Decision(
                key=f"order-completed:{order_id}",
                effects=[
                    Effect_Exec(
                        Exec(
                            statement="credit_balance",
                            params=[Value_Integer(customer_id), Value_Integer(points)],
                        )
                    ),
                    Effect_Exec(
                        Exec(
                            statement="record_ledger",
                            params=[
                                Value_Integer(customer_id),
                                Value_Integer(order_id),
                                Value_Integer(points),
                            ],
                        )
                    ),
                ],
            )
        )
