#!/usr/bin/env bash
# On the GPU machine, after ../shared/gpu's bundle is installed: install the
# plugin and the harness next to vLLM. Idempotent.
set -euo pipefail
. /tmp/gpu/env.sh
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps --no-build-isolation -e . -e validation 2>&1 | grep -v "running pip as\|^WARNING: Running pip" || true
python - <<'PY'
from importlib.metadata import entry_points
names = sorted(e.name for e in entry_points(group="vllm.general_plugins"))
assert {"dsa_dbo", "dsa_dbo_harness"} <= set(names), names
print("vllm.general_plugins:", names)
PY
