#!/usr/bin/env bash
# Run named harness configurations, LANES at a time (default 2 on two GPUs, 1 on
# one GPU, where both DP ranks share GPU 0).
#   validation/run_matrix.sh OUTDIR NAME ... (names from the table below)
# Each NAME writes OUTDIR/NAME.json and OUTDIR/NAME.log. chk_* runs and every
# DeepEP / backend run (ht*, ll*, be_*) have the isolation checker on (audit);
# perf_* runs time microbatched forwards
# (120 tokens each, so 100+ microbatched decode steps per worker). dsv2_* runs
# are the same model as DeepseekV3ForCausalLM (vLLM's torch.compile'd
# deepseek_v2 DSA path), compiled without CUDA graphs or with FULL decode
# graphs; dsv2e_* run it with enforce_eager. DeepEP runs (ht* high-throughput
# eager, ll* low-latency with FULL decode graphs; f = fp8 KV cache, htf also
# prefix caching) use the hidden-2048 model and lift no vLLM check; be_<backend>
# runs force one sparse MLA backend on DeepEP high-throughput (be_auto: vLLM's
# own choice), be_*f with fp8 KV. nf_* is the naive backend (harness gates)
# with fp8 KV and prefix caching. <model>_ht / <model>_ll run one architecture of vLLM 0.34.0
# over DeepEP (8 prompts a rank): ml4 Mistral Large 4 (`index_sharing`, eager / FULL decode
# graphs), dsv2 the deepseek_v2 path (torch.compile'd / compiled with FULL decode graphs; dsv2e_ht
# eager, where stock starts: compiled, stock 0.33.0 did not), hy HYV4 (eager / FULL decode
# graphs), each at hidden size 2048.
# LANES engines run side by side, each taking the next name as one ends; KV_BYTES fixes each
# rank's KV cache (run.py --kv-cache-bytes) where engines start beside each other. A run stops
# after RUN_TIMEOUT seconds (default 420), and none runs past RUN_DEADLINE (epoch seconds) or
# starts with less than 90 s before it. TREE names a vLLM source tree the runs import vLLM from.
set -uo pipefail
. /tmp/gpu/env.sh
out="$1"; shift
mkdir -p "$out"
export VLLM_DSA_DBO_HARNESS=1 VLLM_DBO_COMM_SMS=0 VLLM_USE_FLASHINFER_SAMPLER=0
models="${MODELS:-/tmp/dsa-dbo-models}"
python - "$models" <<'PY'
import sys
from pathlib import Path
from dsa_dbo_harness.model import (
    DEEPEP_CONFIG, DSV2_CONFIG, HYV4_CONFIG, deepep, write_hy_v4_model, write_mistral_large4_model,
    write_model,
)
models = Path(sys.argv[1])
for freq in (1, 4):
    write_model(models / f"freq{freq}", freq)
write_hy_v4_model(models / "hy_v4", 4)
write_model(models / "dsv2", 4, DSV2_CONFIG)
for freq in (1, 4):
    write_model(models / f"deepep{freq}", freq, DEEPEP_CONFIG)
write_model(models / "dsv2_deepep", 4, deepep(DSV2_CONFIG))
write_hy_v4_model(models / "hy_v4_deepep", 4, deepep(HYV4_CONFIG))
write_mistral_large4_model(models / "mistral_large4", 4)
PY

HT="--all2all deepep_ht" LL="--all2all deepep_ll" F8="--kv-cache-dtype fp8" FEW="--prompts 8"
family() {  # FAMILY -> "model mode args" of a run set FAMILY_{off_a,off_b,on_stock,on_fix}
  case "$1" in
    nf)       echo "4 eager $F8 --prefix-caching" ;;
    ht)       echo "deepep4 eager $HT" ;;
    htf)      echo "deepep4 eager $HT $F8 --prefix-caching" ;;
    llf)      echo "deepep4 graph $LL $F8" ;;
    htv2)     echo "deepep4 v2 $HT" ;;
    htp)      echo "deepep4 eager $HT --dbo-decode-token-threshold 100000" ;;
    ht1)      echo "deepep1 eager $HT" ;;
    be_auto)  echo "deepep4 eager $HT --attention-backend auto" ;;
    be_autof) echo "deepep4 eager $HT $F8 --attention-backend auto" ;;
    be_fa)    echo "deepep4 eager $HT --attention-backend FLASH_ATTN_MLA_SPARSE" ;;
    be_fi)    echo "deepep4 eager $HT --attention-backend FLASHINFER_MLA_SPARSE_SM90" ;;
    be_fif)   echo "deepep4 eager $HT $F8 --attention-backend FLASHINFER_MLA_SPARSE_SM90" ;;
    perf_ht)  echo "deepep4 eager $HT --max-tokens 120" ;;
    perf_llf) echo "deepep4 graph $LL $F8 --max-tokens 120" ;;
    ml4_ht)   echo "mistral_large4 eager $HT $FEW" ;;
    ml4_ll)   echo "mistral_large4 graph $LL $FEW" ;;
    dsv2_ht)  echo "dsv2_deepep compiled $HT $FEW" ;;
    dsv2e_ht) echo "dsv2_deepep eager $HT $FEW" ;;
    dsv2_ll)  echo "dsv2_deepep graph $LL $FEW" ;;
    hy_ht)    echo "hy_v4_deepep eager $HT $FEW" ;;
    hy_ll)    echo "hy_v4_deepep graph $LL $FEW" ;;
    *) return 1 ;;
  esac
}
spec() {  # NAME -> "model fix mode dbo-args"; a number N as model means freqN
  local fam="${1%_off*}" run found model mode args
  [ "$fam" = "$1" ] && fam="${1%_on_*}"
  run="${1#"$fam"_}"
  if found="$(family "$fam")"; then
    read -r model mode args <<< "$found"
    case "$run" in
      off|off_a|off_b) echo "$model on $mode $args"; return ;;
      on_stock|on_stock_b) echo "$model off $mode --dbo $args"; return ;;
      on_fix|on_fix_b) echo "$model on $mode --dbo $args"; return ;;
    esac
  fi
  case "$1" in
    off_a|off_b)        echo "4 on eager" ;;
    off_stock)          echo "4 off eager" ;;
    on_stock)           echo "4 off eager --dbo" ;;
    on_fix)             echo "4 on eager --dbo" ;;
    v2_off)             echo "4 on v2" ;;
    v2_on_stock)        echo "4 off v2 --dbo" ;;
    v2_on_fix)          echo "4 on v2 --dbo" ;;
    graph_off)          echo "4 on graph" ;;
    graph_on_stock)     echo "4 off graph --dbo" ;;
    graph_on_fix)       echo "4 on graph --dbo" ;;
    prefill_on_stock)   echo "4 off eager --dbo --dbo-decode-token-threshold 100000" ;;
    prefill_on_fix)     echo "4 on eager --dbo --dbo-decode-token-threshold 100000" ;;
    freq1_off)          echo "1 on eager" ;;
    freq1_on_stock)     echo "1 off eager --dbo" ;;
    freq1_on_fix)       echo "1 on eager --dbo" ;;
    chk_off)            echo "4 on eager --max-tokens 120" ;;
    chk_off_b)          echo "4 off eager --max-tokens 120" ;;
    chk_on_stock|perf_on_stock|perf_on_stock_b)  echo "4 off eager --dbo --max-tokens 120" ;;
    chk_on_fix|perf_on_fix|perf_on_fix_b)        echo "4 on eager --dbo --max-tokens 120" ;;
    perf_freq1_on_stock|perf_freq1_on_stock_b)  echo "1 off eager --dbo --max-tokens 120" ;;
    perf_freq1_on_fix|perf_freq1_on_fix_b)      echo "1 on eager --dbo --max-tokens 120" ;;
    chk_graph_on_stock|perf_graph_on_stock|perf_graph_on_stock_b)  echo "4 off graph --dbo --max-tokens 120" ;;
    chk_graph_on_fix|perf_graph_on_fix|perf_graph_on_fix_b)        echo "4 on graph --dbo --max-tokens 120" ;;
    hy_off)             echo "hy_v4 on eager" ;;
    hy_off_b)           echo "hy_v4 off eager" ;;
    hy_on_stock)        echo "hy_v4 off eager --dbo" ;;
    hy_on_fix)          echo "hy_v4 on eager --dbo" ;;
    dsv2_off)           echo "dsv2 on compiled" ;;
    dsv2_off_b)         echo "dsv2 off compiled" ;;
    dsv2_on_stock)      echo "dsv2 off compiled --dbo" ;;
    dsv2_on_fix)        echo "dsv2 on compiled --dbo" ;;
    dsv2e_off)          echo "dsv2 on eager" ;;
    dsv2e_off_b)        echo "dsv2 off eager" ;;
    dsv2e_on_stock)     echo "dsv2 off eager --dbo" ;;
    dsv2e_on_fix)       echo "dsv2 on eager --dbo" ;;
    dsv2_graph_off)     echo "dsv2 on graph" ;;
    dsv2_graph_on_stock) echo "dsv2 off graph --dbo" ;;
    dsv2_graph_on_fix)  echo "dsv2 on graph --dbo" ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}

one() {
  local name="$1" model fix mode rest
  read -r model fix mode rest <<< "$(spec "$name")" || return 1
  case "$model" in [0-9]*) model="freq$model" ;; esac
  local disable=""; [ "$fix" = off ] && disable=stock
  local check="" measure=""
  local deep_gemm=""
  case "$name" in chk_*) check=audit ;; perf_*) measure=1 ;; esac
  # The upstream PR's DeepEP configuration: no DeepGEMM for GEMMs and MoE.
  case "$name" in
    perf_*) ;;
    ht*|ll*|be_*|*_ht_*|*_ll_*) check=audit deep_gemm=0 ;;
    nf_*) check=audit ;;
  esac
  case "$name" in perf_ht*|perf_ll*) deep_gemm=0 ;; esac
  # DeepEP low-latency asserts NVSHMEM_QP_DEPTH (default 1024) >= 2 * (dispatch cap + 1),
  # and vLLM's cap is max_num_batched_tokens (4096 here).
  local qp_depth=""; case "$name" in ll*|perf_ll*|*_ll_*) qp_depth=8200 ;; esac
  local limit="${RUN_TIMEOUT:-420}"
  if [ -n "${RUN_DEADLINE:-}" ]; then
    local left=$((RUN_DEADLINE - $(date +%s)))
    [ "$left" -ge 90 ] || { echo "$name skipped: ${left}s left before RUN_DEADLINE"; return 0; }
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0=$SECONDS
  VLLM_DSA_DBO_DISABLE="$disable" VLLM_DSA_DBO_CHECK="$check" VLLM_DSA_DBO_HARNESS_MEASURE="$measure" \
    env ${TREE:+PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"} ${deep_gemm:+VLLM_USE_DEEP_GEMM=0 VLLM_MOE_USE_DEEP_GEMM=0} ${qp_depth:+NVSHMEM_QP_DEPTH=$qp_depth} timeout -k 10 "$limit" python -m dsa_dbo_harness.run --timeout $((limit - 20)) \
    --model "$models/$model" --mode "$mode" $rest \
    --gpu-memory-utilization "${GPU_UTIL:-$util}" ${KV_BYTES:+--kv-cache-bytes "$KV_BYTES"} --out "$out/$name.json" > "$out/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s $(grep -h '^WROTE' "$out/$name.log" | cut -c1-300)"
  grep -hE "Error|error:|Traceback|assert" "$out/$name.log" | grep -v "^W1" | tail -4
}

gpus=$(nvidia-smi -L | wc -l)
util=$([ "$gpus" -ge 2 ] && echo 0.35 || echo 0.3)
lanes="${LANES:-$([ "$gpus" -ge 2 ] && echo 2 || echo 1)}"
running=0
for name in "$@"; do
  if [ "$running" -ge "$lanes" ]; then
    wait -n
    running=$((running - 1))
  fi
  one "$name" &
  running=$((running + 1))
done
wait
