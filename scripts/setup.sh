# Everything the tests, the fault suite and the soak need, sourced by scripts/test.sh,
# scripts/faults.sh and scripts/soak.sh (so IDEM_TEST_TANSU is exported to them): services
# up, toolchains (Rust, Python, JavaScript, C and C++ for wasm), Chromium, PgBouncer,
# pg_auto_failover and Prometheus installed, tansu installed, the idem binary and every plugin
# built (by scripts/build-plugins.sh through `idem build`).
# shellcheck shell=bash
root="${root:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"

"$root/scripts/services.sh" --nats
if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2
fi
# The Python and JavaScript plugin toolchains (pinned), for the language tests.
if ! python3 -m pip show componentize-py 2>/dev/null | grep -x 'Version: 0.25.1' >/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check componentize-py==0.25.1
fi
if [ ! -d "$root/plugins/loyalty-js/node_modules" ]; then
  (cd "$root/plugins/loyalty-js" && npm ci --no-audit --no-fund --loglevel=error)
fi
# The Kafka tests' broker: tansu (the Kafka protocol, memory storage); each test starts one on
# its own port.
IDEM_TEST_TANSU="$("$root/scripts/tansu.sh")"
export IDEM_TEST_TANSU
# Debian packages the tests run: Chromium for the console's browser test (driven by
# playwright-core, which downloads no browser of its own), PgBouncer for the pooler tests,
# pg_auto_failover (for the installed PostgreSQL) for the failover scenario, Prometheus
# (prometheus and promtool) for the alert rules and the scrape test; clang, lld, wasi-libc and
# libc++ for wasm32-wasi for the C and C++ plugins.
missing=()
for package in clang lld wasi-libc libclang-rt-14-dev-wasm32 libc++-14-dev-wasm32 libc++abi-14-dev-wasm32; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
[ -x /usr/bin/promtool ] || missing+=(prometheus)
pg_version="$(ls /usr/lib/postgresql 2>/dev/null | sort -V | tail -n1)"
[ -x /usr/bin/pg_autoctl ] || missing+=("postgresql-${pg_version}-auto-failover")
if [ ${#missing[@]} -gt 0 ]; then
  as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
  install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}")
  as_root "${install[@]}" >/dev/null ||
    { as_root apt-get update >/dev/null && as_root "${install[@]}" >/dev/null; }
fi
if [ ! -d "$root/tests/console/node_modules" ]; then
  (cd "$root/tests/console" && npm ci --no-audit --no-fund --loglevel=error)
fi
# The crash tests run the real binary, and every plugin the tests load is built with it
# (`idem build`, as a plugin's author builds one).
cargo build -p idem-host --bin idem
IDEM="${CARGO_TARGET_DIR:-$root/target}/debug/idem" "$root/scripts/build-plugins.sh" >/dev/null
