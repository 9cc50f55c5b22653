#!/usr/bin/env bash
# Per-message plugin overhead (fresh sandbox + call) against a native baseline, release build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/build-plugins.sh >/dev/null
cargo run --quiet --release -p idem-bench --bin plugin-overhead -- plugins/dist/loyalty.wasm
