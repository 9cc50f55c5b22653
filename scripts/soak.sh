#!/usr/bin/env bash
# The nemesis soak: two idem hosts serve a RabbitMQ pipeline (ledger claims), a JetStream
# pipeline (natural claims), an outbox pipeline and a Kafka pipeline (one consumer group, on a
# tansu broker of the soak's own) while a seeded scheduler injects faults (host SIGKILL and
# SIGSTOP, a third Kafka group member joining and leaving, PostgreSQL restart, pg_terminate_backend, pg_cancel_backend,
# schema migrations, a RabbitMQ restart, hot swaps, console and `idem dlq` reads, dead-letter
# replays, a host through a transaction pooler configured for none, the rolling schema move,
# hostile producer headers); then a checker proves every key applied once, no good message
# dead-lettered, nothing left unacked, every outbox row delivered. It prints the seed, the fault timeline and
# the verdict; a failure is tried again with the same seed.
#   scripts/soak.sh                         # the short profile, a random seed
#   scripts/soak.sh --seed 42 --minutes 30  # a long run
# It restarts the local PostgreSQL and RabbitMQ: run it where nothing else depends on them.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
. "$root/scripts/setup.sh"
cargo run -p idem-e2e --bin idem-soak -- "$@"
