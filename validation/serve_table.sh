#!/usr/bin/env bash
# Issue 28's accuracy table on ONE GPU: the trained lookup model served by `vllm serve` with two
# DP ranks on GPU 0 (one process each: rank 0 with the API server, rank 1 headless), expert
# parallel over DeepEP, answering the 500 held-out questions through lm_eval's local-completions
# with --log_samples. One server at a time; the arms:
#   off_a off_b               DBO off (the floor)
#   stock                     DBO on, VLLM_DSA_DBO_DISABLE=stock (vLLM as shipped)
#   fix                       DBO on, the plugin
#   stock_check fix_check     the same with VLLM_DSA_DBO_CHECK=audit, for the checker's counts
#   half_fix                  DBO on, the test-only half fix (VLLM_DSA_DBO_HARNESS_HALF_FIX=1:
#                             converted top-k per microbatch, logical buffer shared)
#   mtp_off mtp_stock mtp_fix DBO off / stock / the fix, with MTP speculative decoding (one
#                             draft token) from the untrained MTP layer `trained mtp` adds
#   mtp3_off mtp3_off_b mtp3_fix   DBO off twice (the MTP floor) / the fix, with MTP at 3
#                             draft tokens
#   f1_off f1_stock           the same weights at index_topk_freq=1 (`trained control`)
#   tree_off tree_fix         DBO off and on in the vLLM tree SERVE_TABLE_TREE names, with only
#                             the harness loaded: validation/upstream_tests.sh leaves the tree
#                             `upstream-patch` made at /tmp/vllm-dsa-dbo-trees/patched/vllm-0.33.0
#   tree_plugin               DBO on in that tree with the plugin loaded too
#   validation/serve_table.sh OUTDIR ht|ll ARM...
#     ht: deepep_high_throughput, eager, fp8 KV cache, prefix caching
#     ll: deepep_low_latency, FULL_DECODE_ONLY CUDA graphs, fp8 KV cache (with the harness's one
#         gate for the bundle's older torch, named in its "microbatched forwards" line)
#   Both serve the model widened to hidden 2048 (`trained widen`): DeepEP's low-latency kernels
#   take 2048-8192, and with high throughput vLLM 0.33.0 pads the MoE input to 256 columns but not
#   the router's 128-wide weight ("mat1 and mat2 shapes cannot be multiplied (4096x256 and 128x8)").
# On the device, from the repo root, after ../shared/gpu's bundle (`GPU_PACK_CHUNK_MB=36 pack`: the
# tree is 26 MB with the checkpoint, and tree plus chunk must stay under 64 MiB), with .whl carried
# (the wheels of validation/lm_eval-wheels.txt and transformers 5.20.2; installed into /tmp/site):
#   bash validation/device_setup.sh && SERVE_TABLE_BUDGET_S=570 \
#     bash validation/serve_table.sh $OUT/ht_a ht off_a stock fix
# (the first arm on a fresh machine takes ~200 s to start, later ones ~2 minutes).
# SERVE_TABLE_LANE=1 moves an arm's ports so that a second script can run beside the first on the
# same GPU, both with SERVE_TABLE_GPU_UTIL=0.2 (default 0.3). Four lanes at 0.1 left vLLM no KV
# cache memory (results/2026-12-02-checker-trees).
# SERVE_TABLE_MAX_TOKENS sets --max-num-batched-tokens (default 4096): at 16384 the copies'
# logical buffer (32 MiB) shows in vLLM's "Model loading took X GiB" (two decimals).
# SERVE_TABLE_KV_BYTES sets each engine's KV cache (--kv-cache-memory-bytes) instead of what
# vLLM's profile leaves of SERVE_TABLE_GPU_UTIL: two ranks profiling on one GPU each count the
# other's memory, so without it the second rank got 0.75 GiB of 42 on an H200 at 0.3.
# OUTDIR.tgz holds summary.md, each process's log, each arm's lm_eval output, /metrics after
# lm_eval (ARM.metrics.txt) and ARM.json (vLLM version, runner, microbatched forwards and
# checker counts per worker, speculative decoding's acceptance); it is rewritten
# after every arm, and an arm that would start after SERVE_TABLE_BUDGET_S seconds (if set) is
# skipped, so a call cut at its limit still brings back the arms it finished. An arm that does not
# start (or an unknown one) stops the script with exit status 1. Afterwards,
# anywhere: `python -m dsa_dbo_harness.serve_report OUTDIR.tgz[:OUTDIR2.tgz]` for the table (in
# validation/), `vllm-dsa-dbo ab off_a stock fix ... --task kv_lookup` in the unpacked folder, and
# `DSA_DBO_TABLE=OUTDIR.tgz pytest validation/test_dbo_equivalence.py` for the bars it must meet.
set -uo pipefail
tgz="$(realpath -m "${1:?usage: serve_table.sh OUTDIR ht|ll ARM...}").tgz" mode="${2:?ht or ll}"
shift 2
case "$mode" in
  ht) backend=deepep_high_throughput
      flags=(--enforce-eager --kv-cache-dtype fp8 --enable-prefix-caching) ;;
  ll) backend=deepep_low_latency
      flags=(--kv-cache-dtype fp8 --no-enable-prefix-caching --compilation-config
        '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 8, 16, 32]}')
      export NVSHMEM_QP_DEPTH=8200 ;;
  *) echo "mode: ht or ll, not $mode"; exit 2 ;;
esac
lane=${SERVE_TABLE_LANE:-0}
[[ $lane =~ ^[0-9]$ ]] || { echo "SERVE_TABLE_LANE: a lane number 0-9, not '$lane'"; exit 2; }
cd "$(dirname "$0")/.."
. /tmp/gpu/env.sh
[ -d .whl ] || { echo "no .whl here: carry it (lm_eval's wheels and transformers)"; exit 2; }
exec 9>/tmp/dsa-dbo-serve.lock && flock 9  # lanes share the wheels and the models made below
[ -f /tmp/site/.installed ] || {  # once: a lane's servers import from it while the next lane starts
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | grep -v "Running pip as\|^WARNING: Target directory"
  touch /tmp/site/.installed; }
site=/tmp/site:$PWD/validation${PYTHONPATH:+:$PYTHONPATH}
export VLLM_DSA_DBO_HARNESS=1 VLLM_DSA_DBO_HARNESS_GATES=0 VLLM_DSA_DBO_HARNESS_LOG_EVERY=1 \
  VLLM_DBO_COMM_SMS=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 VLLM_MOE_USE_DEEP_GEMM=0 \
  CUDA_VISIBLE_DEVICES=0 NCCL_MULTI_RANK_GPU_ENABLE=1 \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=/tmp/dsa-dbo-serve/hf TOKENIZERS_PARALLELISM=false
out=/tmp/dsa-dbo-serve/out/$(basename "$tgz" .tgz)
rm -rf "$out" && mkdir -p "$out" "$(dirname "$tgz")"
exec > >(tee "$out/summary.md") 2>&1

models=/tmp/dsa-dbo-serve/$mode
mkdir -p "$models"
freq4=$models/freq4 freq1=$models/freq1 mtp=$models/mtp
[ -d "$freq4" ] || PYTHONPATH=$site python3 -m dsa_dbo_harness.trained widen \
  validation/kv_lookup/model "$freq4" || exit 1
case " $* " in *" f1_"*)
  [ -d "$freq1" ] || PYTHONPATH=$site python3 -m dsa_dbo_harness.trained control \
    "$freq4" "$freq1" || exit 1 ;;
esac
case " $* " in *" mtp"*)
  [ -d "$mtp" ] || PYTHONPATH=$site python3 -m dsa_dbo_harness.trained mtp "$freq4" "$mtp" || exit 1 ;;
esac
flock -u 9
common=(--data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address 127.0.0.1
  --data-parallel-rpc-port $((13345 + 100 * lane)) --enable-expert-parallel --all2all-backend "$backend"
  --attention-backend FLASHMLA_SPARSE --block-size 64 --max-model-len 1024 --max-num-seqs 64
  --max-num-batched-tokens "${SERVE_TABLE_MAX_TOKENS:-4096}" --seed 0 --gpu-memory-utilization ${SERVE_TABLE_GPU_UTIL:-0.3} "${flags[@]}"
  ${SERVE_TABLE_KV_BYTES:+--kv-cache-memory-bytes "$SERVE_TABLE_KV_BYTES"})
spec=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}')
spec3=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}')
dbo=(--enable-dbo --dbo-decode-token-threshold 4 --dbo-prefill-token-threshold 64)
port=$((8101 + lane))
pids=()

stop() {  # the arm's processes and their children, politely first
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 15); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 1; done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  pids=()
}
trap stop EXIT
trap 'exit 1' INT TERM

healthy() {  # ARM: /health within 300 s, or why not
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt 300 ]; do
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null && continue
      echo "$1: a rank exited during startup"; tail -n 25 "$out/$1".rank*.log; return 1
    done
    python3 -c 'import sys, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=2)' \
      "http://127.0.0.1:$port/health" 2>/dev/null && { echo "$1: up after $((SECONDS - t0)) s"; return 0; }
    sleep 2
  done
  echo "$1: no /health after 300 s"; tail -n 25 "$out/$1".rank*.log; return 1
}

arm() {  # ARM: serve, evaluate, stop
  local name=$1 model=$freq4 disable="" check="" half="" extra=() path=$site plugins=()
  case "$name" in
    off_a|off_b) ;;
    stock) disable=stock extra=("${dbo[@]}") ;;
    fix) extra=("${dbo[@]}") ;;
    half_fix) half=1 extra=("${dbo[@]}") ;;
    mtp_off) model=$mtp extra=("${spec[@]}") ;;
    mtp_stock) model=$mtp disable=stock extra=("${spec[@]}" "${dbo[@]}") ;;
    mtp_fix) model=$mtp extra=("${spec[@]}" "${dbo[@]}") ;;
    stock_check) disable=stock check=audit extra=("${dbo[@]}") ;;
    fix_check) check=audit extra=("${dbo[@]}") ;;
    mtp3_off|mtp3_off_b) model=$mtp extra=("${spec3[@]}") ;;
    mtp3_fix) model=$mtp extra=("${spec3[@]}" "${dbo[@]}") ;;
    f1_off) model=$freq1 ;;
    f1_stock) model=$freq1 disable=stock extra=("${dbo[@]}") ;;
    tree_off|tree_fix|tree_plugin)
      [ -f "${SERVE_TABLE_TREE:-}/vllm/__init__.py" ] || { echo "$name: SERVE_TABLE_TREE names no vLLM tree"; return 1; }
      path=$SERVE_TABLE_TREE:$site plugins=(VLLM_PLUGINS=dsa_dbo_harness)
      [ "$name" = tree_plugin ] && plugins=(VLLM_PLUGINS=dsa_dbo,dsa_dbo_harness)
      [ "$name" != tree_off ] && extra=("${dbo[@]}") ;;
    *) echo "unknown arm $name"; return 1 ;;
  esac
  echo "## $name"
  echo "$name: vLLM from $(PYTHONPATH=$path python3 -c 'import importlib.util as u; print(u.find_spec("vllm").origin)')"
  local t0=$SECONDS run=(setsid env PYTHONPATH="$path" "${plugins[@]}" VLLM_DSA_DBO_DISABLE="$disable" VLLM_DSA_DBO_CHECK="$check"
    VLLM_DSA_DBO_HARNESS_HALF_FIX="$half"
    python3 -m vllm.entrypoints.cli.main serve "$model" "${common[@]}" "${extra[@]}")
  "${run[@]}" --port $port --host 127.0.0.1 --api-server-count 1 --disable-uvicorn-access-log > "$out/$name.rank0.log" 2>&1 &
  pids+=($!)
  "${run[@]}" --headless --data-parallel-start-rank 1 > "$out/$name.rank1.log" 2>&1 &
  pids+=($!)
  healthy "$name" || { stop; return 1; }
  mkdir -p "$out/$name"
  PYTHONPATH=$site timeout 240 python3 -m lm_eval --model local-completions \
    --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,num_concurrent=64,tokenized_requests=False,tokenizer_backend=huggingface,max_retries=1" \
    --tasks kv_lookup --include_path validation/kv_lookup --log_samples \
    --output_path "$out/$name" --seed 0 > "$out/$name/lm_eval.log" 2>&1
  echo "$name: lm_eval rc=$? after $((SECONDS - t0)) s"
  grep -E "strict-match|flexible" "$out/$name/lm_eval.log" | head -2
  python3 -c 'import sys, urllib.request as u; sys.stdout.write(u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=10).read().decode())' \
    "http://127.0.0.1:$port/metrics" > "$out/$name.metrics.txt" 2>&1
  stop
  for rank in 0 1; do
    echo "$name rank $rank: $(grep -c 'keeps shared top-k per DBO microbatch' "$out/$name.rank$rank.log") plugin lines;" \
      "$(grep -h 'dsa_dbo_harness: ' "$out/$name.rank$rank.log" | tail -n 1 | sed 's/.*dsa_dbo_harness: //')"
    grep -hE 'Traceback|Error' "$out/$name.rank$rank.log" | tail -n 3
  done
  PYTHONPATH=$site python3 -m dsa_dbo_harness.serve_report --record "$out" "$name" "$mode" \
    > "$out/$name.json" && cut -c1-400 "$out/$name.json"
  return 0
}

status=0
for name in "$@"; do
  if [ -n "${SERVE_TABLE_BUDGET_S:-}" ] && [ $((SECONDS + 170)) -gt "$SERVE_TABLE_BUDGET_S" ]; then
    echo "## $name: skipped, $SECONDS s of $SERVE_TABLE_BUDGET_S s gone"; continue
  fi
  arm "$name" || { echo "## stopping: $name did not start, and the next arms would not either"; status=1; break; }
  tar -czf "$tgz" -C "$(dirname "$out")" "$(basename "$out")"
done
echo "total $SECONDS s"
tar -czf "$tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit $status
