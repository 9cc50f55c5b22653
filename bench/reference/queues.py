#!/usr/bin/env python3
"""Small RabbitMQ chores for bench/throughput.sh, over AMQP (pika), so the bench needs no
rabbitmqctl and each call takes milliseconds:

  queues.py purge QUEUE...          declare each queue durable if missing, then empty it
  queues.py depth QUEUE             print the messages ready in QUEUE (0 if it does not exist)
  queues.py version                 print the broker's product and version
  queues.py publish QUEUE N [D]     publish N OrderCompleted orders plus round(N*D) redeliveries,
                                    shuffled, persistent, in AMQP transactions; the same
                                    bodies as idem-traffic (for trying the reference consumer
                                    without building idem)

AMQP_URL overrides amqp://guest:guest@127.0.0.1:5672/%2f; CUSTOMERS (default 20) is the
number of customers the published orders are spread over.
"""

from __future__ import annotations

import json
import os
import random
import sys

try:
    import pika
except ImportError as error:  # pragma: no cover
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(f"queues.py: {error}; install it with: python3 -m pip install -r {here}/requirements.txt")

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")


def connect():
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    return connection, connection.channel()


def purge(queues: list[str]) -> None:
    connection, channel = connect()
    for queue in queues:
        channel.queue_declare(queue=queue, durable=True)
        channel.queue_purge(queue=queue)
    connection.close()


def depth(queue: str) -> int:
    connection, channel = connect()
    try:
        return channel.queue_declare(queue=queue, passive=True).method.message_count
    except pika.exceptions.ChannelClosedByBroker as error:
        if error.reply_code == 404:
            return 0
        raise
    finally:
        if connection.is_open:
            connection.close()


def version() -> str:
    connection, _ = connect()
    properties = connection._impl.server_properties  # what the broker announced
    connection.close()

    def text(value):
        return value.decode() if isinstance(value, bytes) else str(value)

    return f"{text(properties.get('product', 'AMQP broker'))} {text(properties.get('version', '?'))}"


def publish(queue: str, orders: int, duplicates: float, customers: int) -> int:
    order_ids = list(range(1, orders + 1))
    # Rounded half away from zero, as idem-traffic does.
    order_ids += [random.randint(1, orders) for _ in range(int(orders * duplicates + 0.5))]
    random.shuffle(order_ids)
    connection, channel = connect()
    channel.queue_declare(queue=queue, durable=True)
    # AMQP transactions of 500 messages: tx_commit returns once the broker has every message
    # of the batch (persisted, for a durable queue), without a round trip per message.
    channel.tx_select()
    properties = pika.BasicProperties(delivery_mode=2, content_type="application/json")
    for index, order_id in enumerate(order_ids, 1):
        body = json.dumps(
            {
                "type": "OrderCompleted",
                "order_id": order_id,
                "customer_id": order_id % customers + 1,
                "total_cents": 500 + (order_id * 7919) % 20_000,
            }
        )
        channel.basic_publish("", queue, body, properties)
        if index % 500 == 0:
            channel.tx_commit()
    channel.tx_commit()
    connection.close()
    return len(order_ids)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "purge":
        purge(argv[1:])
    elif len(argv) == 2 and argv[0] == "depth":
        print(depth(argv[1]))
    elif argv == ["version"]:
        print(version())
    elif len(argv) in (3, 4) and argv[0] == "publish":
        customers = int(os.environ.get("CUSTOMERS", "20"))
        count = publish(argv[1], int(argv[2]), float(argv[3]) if len(argv) == 4 else 0.2, customers)
        print(f"published {count} messages to {argv[1]!r}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
