#!/usr/bin/env bash
# The fault-injection suite (tests/faults): kill -9, crash points, lost COMMIT answers,
# terminated backends, PostgreSQL and RabbitMQ restarts, closed connections, a paused host,
# bad input at volume, a RabbitMQ cluster and a pg_auto_failover formation losing their leader;
# each followed by the total-queue check.
#   scripts/faults.sh          # full profile: 10,000 messages per scenario, 5 kills, 30 s storms
#   scripts/faults.sh short    # the short profile that `scripts/test.sh` (and CI) run
# It restarts the local PostgreSQL and RabbitMQ: run it on a machine where nothing else
# depends on them.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
profile="${1:-full}"
. "$root/scripts/setup.sh"
IDEM_FAULTS="$profile" cargo test -p idem-e2e --test faults -- --nocapture 2>&1 |
  grep --line-buffered -E '^(faults:|soak|cluster:|failover:|test |test result)|verdict|panicked|assertion'
exit "${PIPESTATUS[0]}"
