#!/usr/bin/env bash
# The test command: what the tests need installed, started and built (scripts/setup.sh:
# services, toolchains, Debian packages, tansu, the idem binary and the plugins), then every
# test against real PostgreSQL, RabbitMQ, NATS JetStream and Kafka (tansu). Extra arguments
# go to `cargo test`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
. "$root/scripts/setup.sh"
cargo test --workspace "$@"
