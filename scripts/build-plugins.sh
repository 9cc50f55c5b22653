#!/usr/bin/env bash
# Builds every plugin into plugins/dist/<name>.wasm:
#   Rust (plugins/<name>/Cargo.toml)  with cargo for wasm32-wasip2,
#   Python (plugins/loyalty-py)       with componentize-py,
#   JavaScript (plugins/loyalty-js)   with componentize-js (npm).
# A missing Python or JavaScript toolchain skips that plugin with the command that installs it
# (the tests that need it then fail with the same message); IDEM_REQUIRE_ALL_PLUGINS=1 makes
# it an error. Outputs are replaced by rename, so a host watching a file never reads half of it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="$root/plugins/dist"
mkdir -p "$dist"

install() { # install <built file> <name>
  local target="$dist/$2.wasm"
  if ! cmp -s "$1" "$target"; then
    cp -p "$1" "$target.tmp" && mv -f "$target.tmp" "$target"
  fi
}

up_to_date() { # up_to_date <output> <inputs...>: true when output is newer than every input
  local output="$1"; shift
  [ -f "$output" ] || return 1
  [ -z "$(find "$@" -newer "$output" -print -quit 2>/dev/null)" ]
}

missing() { # missing <what> <install command>
  echo "build-plugins: skipping $1: toolchain missing; install it with: $2" >&2
  if [ "${IDEM_REQUIRE_ALL_PLUGINS:-0}" = 1 ]; then exit 1; fi
}

# --- Rust -----------------------------------------------------------------------------------
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  echo "build-plugins: the wasm32-wasip2 target is missing; install it with: rustup target add wasm32-wasip2" >&2
  exit 1
fi
# A build script calling us must not leak its cargo settings into this separate build.
unset CARGO_TARGET_DIR CARGO_BUILD_TARGET RUSTFLAGS CARGO_ENCODED_RUSTFLAGS RUSTC_WORKSPACE_WRAPPER
cargo build --quiet --release --target wasm32-wasip2 \
  --manifest-path "$root/plugins/Cargo.toml" --target-dir "$root/plugins/target"
for wasm in "$root"/plugins/target/wasm32-wasip2/release/*.wasm; do
  name="$(basename "$wasm" .wasm)"
  install "$wasm" "${name//_/-}" # cargo writes lib names with underscores
done

# --- Python ---------------------------------------------------------------------------------
python_dir="$root/plugins/loyalty-py"
if up_to_date "$dist/loyalty-py.wasm" "$python_dir/app.py" "$root/plugins/idem-py/idem.py" "$root/wit"; then
  :
elif command -v componentize-py >/dev/null; then
  componentize-py -d "$root/wit" -w plugin componentize --stub-wasi \
    -p "$python_dir" -p "$root/plugins/idem-py" app -o "$dist/loyalty-py.wasm.build" >/dev/null
  mv -f "$dist/loyalty-py.wasm.build" "$dist/loyalty-py.wasm"
else
  missing "plugins/loyalty-py" "pip install componentize-py==0.25.1"
fi

# --- JavaScript -----------------------------------------------------------------------------
js_dir="$root/plugins/loyalty-js"
if up_to_date "$dist/loyalty-js.wasm" "$js_dir/loyalty.js" "$js_dir/build.mjs" "$root/plugins/idem-js/idem.js" "$root/wit"; then
  :
elif command -v node >/dev/null && [ -d "$js_dir/node_modules/@bytecodealliance/componentize-js" ]; then
  node "$js_dir/build.mjs" "$dist/loyalty-js.wasm.build" >/dev/null
  mv -f "$dist/loyalty-js.wasm.build" "$dist/loyalty-js.wasm"
else
  missing "plugins/loyalty-js" "(cd plugins/loyalty-js && npm ci)"
fi

ls "$dist"
