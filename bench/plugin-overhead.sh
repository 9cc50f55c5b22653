#!/usr/bin/env bash
# Per-message plugin overhead (fresh sandbox + call), size, compile time and memory per call,
# for the loyalty plugin in every language built, against a native baseline; release build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/build-plugins.sh >/dev/null
plugins=()
for name in loyalty loyalty-py loyalty-js loyalty-c; do
  [ -f "plugins/dist/$name.wasm" ] && plugins+=("plugins/dist/$name.wasm")
done
cargo run --quiet --release -p idem-bench --bin plugin-overhead -- "${plugins[@]}"
