#!/usr/bin/env bash
# Issue 62 in one device call, on one GPU with the vLLM 0.34.0 bundle installed: each shared
# top-k architecture under DBO over DeepEP with the isolation checker on (audit), stock against
# the fix, two DP ranks on GPU 0 (run_matrix.sh's ml4_*, dsv2_*, hy_* pairs), and DeepSeek-V4.1's
# hand-off bench (bench/v41_handoff.py, stock and fix in one script).
#   bash validation/device_setup.sh && bash validation/device_paths.sh [SET]
# High-throughput and low-latency runs go in lanes of their own, three and two engines (five
# engines, ten rank processes at once): a low-latency engine holds several GiB of DeepEP buffers,
# so at most two of them run together. Within each, the pairs run in order of what they add:
# Mistral Large 4 (new in 0.34.0) first, HYV4 (run on 0.33.0) last. Each rank's KV cache is fixed (KV_BYTES): engines starting side
# by side would otherwise each count the others' memory against their own. Nothing starts after
# 430 s, so the call ends within 480 s. Leaves $OUT/SET.tgz only (each run's JSON and log,
# pairs.jsonl from `compare --pairs`, the bench's JSON and log), and prints the pairs.
set -uo pipefail
set_name="${1:-paths}"
here="$(cd "$(dirname "$0")" && pwd)"
dir="$OUT/$set_name"
mkdir -p "$dir"
cd "$here/.."
. /tmp/gpu/env.sh
HT_RUNS="ml4_ht_on_stock ml4_ht_on_fix dsv2e_ht_on_stock dsv2e_ht_on_fix dsv2_ht_on_fix
  dsv2_ht_on_stock hy_ht_on_stock hy_ht_on_fix"
LL_RUNS="ml4_ll_on_stock ml4_ll_on_fix dsv2_ll_on_stock dsv2_ll_on_fix hy_ll_on_stock hy_ll_on_fix"
export GPU_UTIL="${GPU_UTIL:-0.08}" KV_BYTES="${KV_BYTES:-536870912}" RUN_TIMEOUT=300
export RUN_DEADLINE=$(($(date +%s) + 430))
timeout -k 10 300 python bench/v41_handoff.py --json "$dir/v41_handoff.json" \
  > "$dir/v41_handoff.log" 2>&1 &
# shellcheck disable=SC2086
LANES=3 MODELS=/tmp/dsa-dbo-models-ht bash "$here/run_matrix.sh" "$dir" $HT_RUNS > "$dir/ht.log" 2>&1 &
# shellcheck disable=SC2086
LANES=2 MODELS=/tmp/dsa-dbo-models-ll bash "$here/run_matrix.sh" "$dir" $LL_RUNS > "$dir/ll.log" 2>&1 &
wait
cat "$dir/ht.log" "$dir/ll.log"
tail -3 "$dir/v41_handoff.log"
python -m dsa_dbo_harness.compare --pairs "$dir" > "$dir/pairs.jsonl"
echo "pairs hold: rc=$?"
cut -c1-1500 "$dir/pairs.jsonl"
tar -czf "$OUT/$set_name.tgz" -C "$OUT" "$set_name" && rm -rf "$dir"
