#!/usr/bin/env bash
# The demo: the guide's loyalty consumer end to end on this machine.
# Starts PostgreSQL and RabbitMQ if they are down, builds idem and the loyalty plugin,
# recreates the `idem_demo` database, runs `idem run`, publishes 1,000 OrderCompleted events
# with 20% duplicate deliveries and 3 malformed ones, waits until they are settled, stops
# the host with SIGTERM, and shows what landed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

orders="${DEMO_ORDERS:-1000}"
admin_url="postgres://postgres@127.0.0.1:5432/postgres"
export DATABASE_URL="postgres://postgres@127.0.0.1:5432/idem_demo"
export AMQP_URL="amqp://guest:guest@127.0.0.1:5672/%2f"
queue="order-completed"

scripts/services.sh
if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2
fi
echo "demo: building idem and the loyalty plugin"
cargo build --quiet -p idem-host --bin idem -p idem-e2e --bin idem-traffic
idem="$root/target/debug/idem"
IDEM="$idem" scripts/build-plugins.sh >/dev/null

echo "demo: fresh database idem_demo, empty queues"
psql "$admin_url" -q -c "DROP DATABASE IF EXISTS idem_demo WITH (FORCE)" -c "CREATE DATABASE idem_demo"
"$idem" migrate --config pipelines.toml
psql "$DATABASE_URL" -q -f examples/loyalty/schema.sql
for q in "$queue" "$queue.dead-letter"; do
  rabbitmqctl --quiet purge_queue "$q" >/dev/null 2>&1 || true
done
"$idem" check --config pipelines.toml

queue_depth() { # ready + unacked of one queue
  rabbitmqctl list_queues --quiet --no-table-headers name messages_ready messages_unacknowledged 2>/dev/null |
    awk -v q="$1" '$1 == q { print $2 + $3; found = 1 } END { if (!found) print 0 }'
}

echo "demo: starting idem run"
"$idem" run --config pipelines.toml &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' EXIT

start_ns=$(date +%s%N)
target/debug/idem-traffic --queue "$queue" --orders "$orders" --duplicates 0.2 --poison
for _ in $(seq 1 600); do
  applied=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM point_ledger")
  if [ "$applied" -ge "$orders" ] && [ "$(queue_depth "$queue")" -eq 0 ]; then break; fi
  sleep 0.2
done
elapsed_ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))
outcomes=""
if command -v curl >/dev/null; then
  outcomes="$(curl -fsS http://127.0.0.1:9464/metrics | grep '^idem_messages_total' || true)"
fi

kill -TERM "$pid"
wait "$pid"
trap - EXIT

echo
echo "== results (settled in ${elapsed_ms} ms, publishing included) =="
psql "$DATABASE_URL" -P pager=off -c "
  SELECT (SELECT count(*) FROM point_ledger)                   AS ledger_rows,
         (SELECT count(DISTINCT order_id) FROM point_ledger)   AS distinct_orders,
         (SELECT count(*) FROM processed_messages)             AS claims,
         (SELECT sum(points) FROM point_ledger)                AS ledger_points,
         (SELECT sum(points) FROM balances)                    AS balance_points"
echo "top balances:"
psql "$DATABASE_URL" -P pager=off -c "SELECT customer_id, points FROM balances ORDER BY points DESC, customer_id LIMIT 5"
echo "dead-lettered messages (malformed input, reason in the x-idem-reason header): $(queue_depth "$queue.dead-letter")"
echo "messages left in $queue: $(queue_depth "$queue")"
if [ -n "$outcomes" ]; then
  echo "outcomes counted by the host (/metrics):"
  echo "$outcomes"
fi
