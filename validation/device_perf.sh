#!/usr/bin/env bash
# Issue 59's step time on Model Runner V2 in one device call, on one GPU with the vLLM 0.34.0
# bundle installed: stock against the fix, each microbatched forward timed in the workers
# (run_matrix.sh's perf_ht_* with DeepEP high-throughput, eager; perf_llf_* with low-latency,
# FULL decode graphs, fp8 KV cache), then bench/engine_step.py's median step ratio.
#   bash validation/device_setup.sh && bash validation/device_perf.sh [SET] [ht|ll|both]
# One engine at a time: a second engine on the GPU would time its own load into the other's
# steps. Nothing starts after 280 s, so the call ends within 300 s; a pair cut short leaves its
# ratio out. Each rank's KV cache is fixed at 1 GiB: two ranks profiling on one GPU count each
# other's memory. Leaves $OUT/SET.tgz only (each run's JSON and log, engine_step.json).
set -uo pipefail
set_name="${1:-perf}" which="${2:-both}"
here="$(cd "$(dirname "$0")" && pwd)"
dir="$OUT/$set_name"
mkdir -p "$dir"
cd "$here/.."
. /tmp/gpu/env.sh
case "$which" in
  ht) runs="perf_ht_on_stock perf_ht_on_fix" ;;
  ll) runs="perf_llf_on_stock perf_llf_on_fix" ;;
  both) runs="perf_ht_on_stock perf_ht_on_fix perf_llf_on_stock perf_llf_on_fix" ;;
  *) echo "ht, ll or both, not $which"; exit 2 ;;
esac
export LANES=1 RUN_TIMEOUT=200 RUN_DEADLINE=$(($(date +%s) + 280)) KV_BYTES="${KV_BYTES:-1073741824}"
# shellcheck disable=SC2086
bash "$here/run_matrix.sh" "$dir" $runs 2>&1 | tee "$dir/matrix.log"
python bench/engine_step.py "$dir" --json "$dir/engine_step.json"
tar -czf "$OUT/$set_name.tgz" -C "$OUT" "$set_name" && rm -rf "$dir"
