#!/usr/bin/env bash
# Builds every plugin in plugins/ into plugins/dist/<directory>.wasm with `idem build`, as a
# plugin's author builds one: Rust crates (cargo for wasm32-wasip2), Python (componentize-py),
# JavaScript (componentize-js) and C (clang for wasm32-wasi).
# The idem binary is $IDEM, or this checkout's debug build (built here when missing).
# A missing Python, JavaScript or C toolchain skips that plugin with the command that installs
# it (the tests that need it then fail with the same message); IDEM_REQUIRE_ALL_PLUGINS=1
# makes it an error. `idem build` replaces each output by rename, so a host watching a file
# never reads half of it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="$root/plugins/dist"
mkdir -p "$dist"

if [ -z "${IDEM:-}" ]; then
  cargo build --quiet --manifest-path "$root/Cargo.toml" -p idem-host --bin idem
  IDEM="${CARGO_TARGET_DIR:-$root/target}/debug/idem"
fi

up_to_date() { # up_to_date <output> <inputs...>: true when output is newer than every input
  local output="$1"; shift
  [ -f "$output" ] || return 1
  [ -z "$(find -L "$@" -newer "$output" -print -quit 2>/dev/null)" ]
}

missing() { # missing <what> <install command>
  echo "build-plugins: skipping $1: toolchain missing; install it with: $2" >&2
  if [ "${IDEM_REQUIRE_ALL_PLUGINS:-0}" = 1 ]; then exit 1; fi
}

build() { # build <plugin directory>: plugins/dist/<directory>.wasm
  "$IDEM" build "$1" --output "$dist/$(basename "$1").wasm" >/dev/null
}

# --- Rust: every cdylib crate of the plugins' workspace (cargo rebuilds only what changed) ---
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  echo "build-plugins: the wasm32-wasip2 target is missing; install it with: rustup target add wasm32-wasip2" >&2
  exit 1
fi
for manifest in "$root"/plugins/*/Cargo.toml; do
  grep -q 'crate-type *= *\["cdylib"\]' "$manifest" && build "$(dirname "$manifest")"
done

# --- Python ---------------------------------------------------------------------------------
python_dir="$root/plugins/loyalty-py"
if up_to_date "$dist/loyalty-py.wasm" "$python_dir" "$root/plugins/idem-py" "$root/wit"; then
  :
elif command -v componentize-py >/dev/null; then
  build "$python_dir"
else
  missing "plugins/loyalty-py" "pip install componentize-py==0.25.1"
fi

# --- JavaScript -----------------------------------------------------------------------------
js_dir="$root/plugins/loyalty-js"
if up_to_date "$dist/loyalty-js.wasm" "$js_dir/loyalty.js" "$js_dir/build.mjs" "$js_dir/package-lock.json" "$root/plugins/idem-js" "$root/wit"; then
  :
elif command -v node >/dev/null && command -v npm >/dev/null; then
  build "$js_dir"
else
  missing "plugins/loyalty-js" "apt install nodejs npm"
fi

# --- C --------------------------------------------------------------------------------------
c_dir="$root/plugins/loyalty-c"
if up_to_date "$dist/loyalty-c.wasm" "$c_dir/loyalty.c" "$c_dir/idem.toml" "$root/plugins/idem-c" "$root/wit"; then
  :
elif command -v clang >/dev/null; then
  build "$c_dir"
else
  missing "plugins/loyalty-c" "apt install clang lld wasi-libc libclang-rt-14-dev-wasm32"
fi

ls "$dist"
