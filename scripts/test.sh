#!/usr/bin/env bash
# The test command: services up, plugins built (by tests/build.rs), every test against
# real PostgreSQL and RabbitMQ. Extra arguments go to `cargo test`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

"$root/scripts/services.sh"
if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2
fi
# The crash tests run the real binary; build it before the tests look for it.
cargo build -p idem-host --bin idem
cargo test --workspace "$@"
