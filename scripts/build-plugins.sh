#!/usr/bin/env bash
# Builds every Rust plugin for wasm32-wasip2 into plugins/dist/<name>.wasm.
# The plugins have their own workspace and target dir, so this never waits on the host's build.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  echo "build-plugins: the wasm32-wasip2 target is missing; install it with: rustup target add wasm32-wasip2" >&2
  exit 1
fi

# A build script calling us must not leak its cargo settings into this separate build.
unset CARGO_TARGET_DIR CARGO_BUILD_TARGET RUSTFLAGS CARGO_ENCODED_RUSTFLAGS RUSTC_WORKSPACE_WRAPPER

cargo build --quiet --release --target wasm32-wasip2 \
  --manifest-path "$root/plugins/Cargo.toml" --target-dir "$root/plugins/target"

# plugins/<dir>/ becomes plugins/dist/<dir>.wasm (cargo writes lib names with underscores).
# Replaced by rename, so a host watching the file never reads a half-written one.
mkdir -p "$root/plugins/dist"
for wasm in "$root"/plugins/target/wasm32-wasip2/release/*.wasm; do
  name="$(basename "$wasm" .wasm)"
  target="$root/plugins/dist/${name//_/-}.wasm"
  if ! cmp -s "$wasm" "$target"; then
    cp -p "$wasm" "$target.tmp" && mv -f "$target.tmp" "$target"
  fi
done
ls "$root/plugins/dist"
