#!/usr/bin/env python3
"""The guide's reference consumer ("Idempotent Consumers with Postgres Unique Constraints",
Step 2), as a benchmark baseline for idem.

For each OrderCompleted message: one psycopg transaction that inserts the claim
(`processed_messages`, ON CONFLICT DO NOTHING) and, only if the claim inserted a row, credits
the balance and writes the ledger row; commit; then basic_ack (ack after commit, either way).

The guide credits with `UPDATE balances ... WHERE customer_id = %s`, which presumes a balance
row per customer; like idem's demo pipeline (pipelines.toml, `credit_balance`) this uses the
upsert, so a customer's first order creates the row. Otherwise the statements, their order,
the branch on the claim's rowcount and the ack after commit are the guide's.

--workers K runs K processes, each with its own PostgreSQL connection and its own AMQP
connection and channel (basic_qos(prefetch) on each). The clock starts when every worker is
connected and starts consuming, and stops at the last ack; connection set-up is not timed.
A worker stops when the workers together have acked --expect messages, or when it received
nothing for --idle-timeout seconds. The last line on stdout is one JSON object with the
figures (messages/second, outcomes, latency percentiles, peak RSS); a human summary goes to
stderr.

Latency is per message, from the delivery reaching the callback to after basic_ack, the same
span as idem's `idem_message_seconds` (a worker taking the delivery to its settlement).

--kafka BROKERS --topic T reads a Kafka topic instead (confluent-kafka): each worker process
is a consumer of the group `reference` (automatic offset commits off), and the guide's ack
after commit becomes the offset commit after the transaction commits, sent without waiting
for its reply (as basic_ack is), with a synchronous commit of the last offsets at the end.
The clock starts at the first message (the group assigns partitions seconds after joining).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time

try:
    import confluent_kafka
    import pika
    import psycopg
except ImportError as error:  # pragma: no cover - a setup problem, said plainly
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(
        f"consumer.py: {error}; install the dependencies with: "
        f"python3 -m pip install -r {os.path.join(here, 'requirements.txt')}"
    )

CONSUMER = "loyalty"


def points_for(msg: dict) -> int:
    return msg["total_cents"] // 100


# The guide's handler, statement for statement (see the module docstring for the upsert).
def handle_order_completed(conn: psycopg.Connection, msg: dict) -> str:
    with conn.transaction():
        claimed = conn.execute(
            """INSERT INTO processed_messages (consumer, message_key)
               VALUES ('loyalty', %s) ON CONFLICT DO NOTHING""",
            (f"order-completed:{msg['order_id']}",),
        ).rowcount
        if claimed == 0:
            return "duplicate"  # already applied: no-op
        conn.execute(
            """INSERT INTO balances (customer_id, points) VALUES (%s, %s)
               ON CONFLICT (customer_id) DO UPDATE SET points = balances.points + EXCLUDED.points""",
            (msg["customer_id"], points_for(msg)),
        )
        conn.execute(
            "INSERT INTO point_ledger (customer_id, order_id, points) VALUES (%s, %s, %s)",
            (msg["customer_id"], msg["order_id"], points_for(msg)),
        )
    return "applied"


def worker(index: int, args: argparse.Namespace, acked, ready, go, results) -> None:
    try:
        outcome = run_worker(args, acked, ready, go)
    except BaseException as error:  # report instead of dying silently
        ready.release()
        results.put({"worker": index, "error": f"{type(error).__name__}: {error}"})
        raise SystemExit(1)
    outcome["worker"] = index
    results.put(outcome)


def run_worker(args: argparse.Namespace, acked, ready, go) -> dict:
    if args.kafka:
        return run_kafka_worker(args, acked, ready, go)
    # autocommit: conn.transaction() then issues BEGIN ... COMMIT itself, one per message.
    conn = psycopg.connect(args.database_url, autocommit=True)
    connection = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    channel = connection.channel()
    channel.queue_declare(queue=args.queue, passive=True)  # the queue must exist already
    channel.basic_qos(prefetch_count=args.prefetch)

    counts = {"applied": 0, "duplicate": 0}
    latencies: list[float] = []
    state = {"last": time.monotonic(), "last_ack": None, "stop": False}

    def on_message(channel, method, properties, body):
        received = time.monotonic()
        result = handle_order_completed(conn, json.loads(body))
        channel.basic_ack(method.delivery_tag)  # ack AFTER commit, either way
        done = time.monotonic()
        counts[result] += 1
        latencies.append(done - received)
        state["last"] = state["last_ack"] = done
        if args.expect:
            with acked.get_lock():
                acked.value += 1
                total = acked.value
            if total >= args.expect:
                state["stop"] = True

    ready.release()
    go.wait()
    state["last"] = time.monotonic()
    tag = channel.basic_consume(queue=args.queue, on_message_callback=on_message)
    while not state["stop"]:
        connection.process_data_events(time_limit=0.05)
        now = time.monotonic()
        if args.expect and acked.value >= args.expect:
            break
        if now - state["last"] >= args.idle_timeout:
            break
    channel.basic_cancel(tag)
    connection.close()  # prefetched but unacked deliveries go back to the queue
    conn.close()
    return {
        "applied": counts["applied"],
        "duplicate": counts["duplicate"],
        "last_ack": state["last_ack"],
        "latencies": latencies,
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def run_kafka_worker(args: argparse.Namespace, acked, ready, go) -> dict:
    conn = psycopg.connect(args.database_url, autocommit=True)
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": args.kafka,
            "group.id": "reference",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            # The test broker (tansu) holds a new group's first assignment half a session.
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
        }
    )
    consumer.subscribe([args.topic])
    counts = {"applied": 0, "duplicate": 0}
    latencies: list[float] = []
    last = last_ack = None
    ready.release()
    go.wait()
    last = time.monotonic()
    first = None
    while True:
        message = consumer.poll(0.05)
        now = time.monotonic()
        if message is None or message.error():
            if args.expect and acked.value >= args.expect:
                break
            if now - last >= args.idle_timeout:
                break
            continue
        if first is None:
            first = now
        result = handle_order_completed(conn, json.loads(message.value()))
        consumer.commit(message=message, asynchronous=True)  # the offset AFTER commit
        done = time.monotonic()
        counts[result] += 1
        latencies.append(done - now)
        last = last_ack = done
        if args.expect:
            with acked.get_lock():
                acked.value += 1
            if acked.value >= args.expect:
                break
    try:
        consumer.commit(asynchronous=False)
    except confluent_kafka.KafkaException as error:
        # Nothing consumed since the last commit (or no partition at all): nothing to commit.
        if error.args[0].code() != confluent_kafka.KafkaError._NO_OFFSET:
            raise
    consumer.close()
    conn.close()
    return {
        "applied": counts["applied"],
        "duplicate": counts["duplicate"],
        "last_ack": last_ack,
        "first_message": first,
        "latencies": latencies,
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def percentile(sorted_values: list[float], fraction: float) -> float | None:
    if not sorted_values:
        return None
    rank = fraction * (len(sorted_values) - 1)
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", default="order-completed")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/idem_demo"),
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
    )
    parser.add_argument("--kafka", help="Kafka brokers (host:port,...): read --topic instead of --queue")
    parser.add_argument("--topic", help="the Kafka topic, with --kafka")
    parser.add_argument("--workers", type=int, default=1, help="processes, each with its own connections")
    parser.add_argument("--prefetch", type=int, default=64, help="basic_qos prefetch per channel")
    parser.add_argument("--expect", type=int, default=0, help="stop after this many acks in all")
    parser.add_argument("--idle-timeout", type=float, default=1.0, help="stop after this long with no message (s)")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if bool(args.kafka) != bool(args.topic):
        parser.error("--kafka and --topic go together")

    context = mp.get_context("fork")
    acked = context.Value("q", 0)
    ready = context.Semaphore(0)
    go = context.Event()
    results = context.Queue()
    processes = [
        context.Process(target=worker, args=(index, args, acked, ready, go, results), daemon=True)
        for index in range(args.workers)
    ]
    for process in processes:
        process.start()
    for _ in processes:
        ready.acquire()
    started = time.monotonic()
    go.set()

    reports = [results.get() for _ in processes]
    for process in processes:
        process.join()
    errors = [f"worker {r['worker']}: {r['error']}" for r in reports if "error" in r]
    if errors:
        for error in errors:
            print(f"consumer.py: {error}", file=sys.stderr)
        return 1

    messages = sum(r["applied"] + r["duplicate"] for r in reports)
    last_acks = [r["last_ack"] for r in reports if r["last_ack"] is not None]
    # A Kafka group assigns its partitions some seconds after the consumers join (as it
    # does idem's): the clock starts at the first message, as idem's and raw-consume's do.
    firsts = [r["first_message"] for r in reports if r.get("first_message") is not None]
    if args.kafka and firsts:
        started = min(firsts)
    elapsed = (max(last_acks) - started) if last_acks else 0.0
    latencies = sorted(value for r in reports for value in r["latencies"])
    summary = {
        "workers": args.workers,
        "prefetch": args.prefetch,
        "messages": messages,
        "applied": sum(r["applied"] for r in reports),
        "duplicate": sum(r["duplicate"] for r in reports),
        "seconds": round(elapsed, 6),
        "messages_per_second": round(messages / elapsed, 1) if elapsed > 0 else 0.0,
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 3) if latencies else None,
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 3) if latencies else None,
        # Sum over the worker processes (each has its own interpreter).
        "peak_rss_kib": sum(r["max_rss_kib"] for r in reports),
    }
    print(
        f"reference consumer: {messages} messages in {elapsed:.3f} s with {args.workers} worker(s): "
        f"{summary['messages_per_second']} msg/s, applied {summary['applied']}, "
        f"duplicate {summary['duplicate']}, p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms",
        file=sys.stderr,
    )
    print(json.dumps(summary))
    if args.expect and messages < args.expect:
        print(
            f"consumer.py: stopped after {messages} of {args.expect} expected messages "
            f"(nothing received for {args.idle_timeout} s)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
