#!/usr/bin/env bash
# Issue 62 item 2 in one device call: a vLLM 0.34.0 tree that `upstream-patch` made from the
# sdist, with the plugin loaded, running the deepseek_v2-path model compiled under DBO over DeepEP
# with the isolation checker on: the tree alone (VLLM_DSA_DBO_DISABLE=stock; the change leaves
# this path out) against the tree with the plugin (its traced code reads microbatch 0's state of
# the tree's groups: `traced_ubatch0_groups` per worker). HT torch.compile'd and LL compiled with
# FULL decode graphs, one engine per mode at a time.
# Here first: the 0.34.0 sdist, trimmed to the trees' part, carried as .vllm-sdist:
#   .nox/tests-vllm-0-34-0/bin/python tests/vllm_sdist.py trim .vllm-sdist
# On the device (carry .vllm-sdist), with the 0.34.0 bundle installed:
#   bash validation/device_setup.sh && bash validation/device_tree.sh [SET]
# Nothing starts after 430 s. Leaves $OUT/SET.tgz only (tree.log, tree_status.txt, each run's
# JSON and log, pairs.jsonl).
set -uo pipefail
set_name="${1:-tree}"
here="$(cd "$(dirname "$0")" && pwd)"
dir="$OUT/$set_name"
mkdir -p "$dir"
cd "$here/.."
. /tmp/gpu/env.sh
export RUN_DEADLINE=$(($(date +%s) + 430))
trees=/tmp/vllm-dsa-dbo-trees
rm -rf "$trees"
VLLM_DSA_DBO_SDIST="${VLLM_DSA_DBO_SDIST:-$PWD/.vllm-sdist/vllm-0.34.0.tar.gz}" python -c "
import sys; sys.path[:0] = ['tests']
from pathlib import Path
import upstream_tree as t
_, patched = t.prepare(Path('$trees'))
print(patched, t.imports_from(patched))
print(t.sources_differing_from_installed(patched))" > "$dir/tree.log" 2>&1
tree="$(ls -d "$trees"/patched/vllm-0.34.0 2>/dev/null)"
cat "$dir/tree.log"
[ -n "$tree" ] || { tar -czf "$OUT/$set_name.tgz" -C "$OUT" "$set_name"; exit 1; }
(cd /tmp && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python -m vllm_dsa_dbo.cli status) \
  > "$dir/tree_status.txt" 2>&1
echo "status in the tree: rc=$?"
export TREE="$tree" GPU_UTIL="${GPU_UTIL:-0.1}" KV_BYTES="${KV_BYTES:-536870912}" RUN_TIMEOUT=300
LANES=1 MODELS=/tmp/dsa-dbo-models-ht bash "$here/run_matrix.sh" "$dir" \
  dsv2_ht_on_fix dsv2_ht_on_stock > "$dir/ht.log" 2>&1 &
LANES=1 MODELS=/tmp/dsa-dbo-models-ll bash "$here/run_matrix.sh" "$dir" \
  dsv2_ll_on_fix dsv2_ll_on_stock > "$dir/ll.log" 2>&1 &
wait
cat "$dir/ht.log" "$dir/ll.log"
python -m dsa_dbo_harness.compare --pairs "$dir" > "$dir/pairs.jsonl"
echo "pairs hold: rc=$?"
cut -c1-1500 "$dir/pairs.jsonl"
tar -czf "$OUT/$set_name.tgz" -C "$OUT" "$set_name" && rm -rf "$dir"
