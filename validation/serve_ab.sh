#!/usr/bin/env bash
# `vllm serve` A/B on 2 GPUs: the tiny GLM-5-shaped model (DP=2, expert parallel) without DBO,
# with DBO stock and with DBO and the fix, each answering our GSM8K-format task through lm_eval's
# local-completions model; `vllm-dsa-dbo ab` then compares lm_eval's samples question by question.
#   validation/serve_ab.sh OUTDIR
# On the device, from the repo root, after the ../shared/gpu bundle, with .whl carried (lm_eval
# 0.4.13 and what the image lacks for it; installed here into /tmp/site):
#   bash validation/device_setup.sh && bash validation/serve_ab.sh $OUT
# Two servers run at a time, each on both GPUs: off_a (no DBO) + on_stock (DBO,
# VLLM_DSA_DBO_DISABLE=stock), then off_b (no DBO) + on_fix (DBO, plugin on). OUTDIR ends with
# summary.md, ab.md, one <name>.log per server and samples.tar.gz (lm_eval outputs, the model
# folder).
set -uo pipefail
out="$(realpath -m "${1:?usage: serve_ab.sh OUTDIR}")"
cd "$(dirname "$0")/.."
. /tmp/gpu/env.sh
[ -d .whl ] || { echo "no .whl here: carry it (lm_eval and its wheels)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>&1 | grep -v "Running pip as\|^WARNING: Target directory" || true
lm_path=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_DSA_DBO_HARNESS=1 VLLM_DBO_COMM_SMS=0 VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=/tmp/dsa-dbo-serve/hf TOKENIZERS_PARALLELISM=false
mkdir -p "$out"
summary="$out/summary.md"
model="$out/model"
task=validation/gsm8k_local
budget=${BUDGET_S:-540}
exec > >(tee "$summary") 2>&1
python3 -m dsa_dbo_harness.serve "$model" "$task" --index-topk-freq 4 || exit 1
PYTHONPATH=$lm_path python3 -c "import lm_eval, datasets; print('lm_eval', lm_eval.__version__, 'datasets', datasets.__version__)" || exit 1

common=(--data-parallel-size 2 --enable-expert-parallel --all2all-backend allgather_reducescatter
  --load-format dummy --enforce-eager --block-size 64 --max-model-len 4096 --max-num-seqs 64
  --max-num-batched-tokens 4096 --no-enable-prefix-caching --attention-backend FLASHMLA_SPARSE
  --seed 0 --gpu-memory-utilization 0.2 --host 127.0.0.1 --disable-uvicorn-access-log)
dbo=(--enable-dbo --dbo-decode-token-threshold 4 --dbo-prefill-token-threshold 64)
declare -A pid port
port=([off_a]=8101 [on_stock]=8102 [off_b]=8103 [on_fix]=8104)

start() {  # NAME DISABLE(1 or empty) [DBO flags]: a server in its own process group
  local name=$1 disable=$2; shift 2
  VLLM_DSA_DBO_DISABLE="$disable" setsid python3 -m vllm.entrypoints.cli.main serve "$model" \
    --port "${port[$name]}" "${common[@]}" "$@" > "$out/$name.log" 2>&1 &
  pid[$name]=$!
}

healthy() {  # NAME: wait for /health (240 s at most, less near the budget), or say why not
  local name=$1 t0=$SECONDS limit=$((budget - SECONDS - 100))
  [ "$limit" -gt 240 ] && limit=240
  while [ $((SECONDS - t0)) -lt "$limit" ]; do
    if ! kill -0 "${pid[$name]}" 2>/dev/null; then
      echo "$name: server exited during startup; log tail:"; tail -25 "$out/$name.log"; return 1
    fi
    python3 -c 'import sys, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=2)' \
      "http://127.0.0.1:${port[$name]}/health" 2>/dev/null && { echo "$name: up after $((SECONDS - t0)) s"; return 0; }
    sleep 2
  done
  echo "$name: no /health after $limit s; log tail:"; tail -25 "$out/$name.log"; return 1
}

stop() {  # NAME ...: ask each server to shut down, then end what is left of its process group
  local name t0
  for name in "$@"; do [ -n "${pid[$name]:-}" ] && kill -TERM "${pid[$name]}" 2>/dev/null; done
  for name in "$@"; do
    [ -n "${pid[$name]:-}" ] || continue
    t0=$SECONDS
    while kill -0 -- "-${pid[$name]}" 2>/dev/null && [ $((SECONDS - t0)) -lt 15 ]; do sleep 1; done
    kill -KILL -- "-${pid[$name]}" 2>/dev/null
    unset "pid[$name]"
  done
}
trap 'stop "${!pid[@]}"' EXIT
trap 'exit 1' INT TERM

evaluate() {  # NAME: lm_eval's local-completions against the server
  local name=$1 t0=$SECONDS
  mkdir -p "$out/$name"
  PYTHONPATH=$lm_path timeout 180 python3 -m lm_eval --model local-completions \
    --model_args "model=$model,base_url=http://127.0.0.1:${port[$name]}/v1/completions,num_concurrent=64,tokenized_requests=False,tokenizer_backend=huggingface,max_retries=1" \
    --tasks gsm8k_local --include_path "$task" --num_fewshot 8 --log_samples \
    --output_path "$out/$name" --seed 0 > "$out/$name/lm_eval.log" 2>&1
  echo "$name: lm_eval rc=$? in $((SECONDS - t0)) s"; tail -4 "$out/$name/lm_eval.log"
}

pair() {  # REF DISABLE RUN: REF without DBO and RUN with DBO, up together
  local ref=$1 disable=$2 run=$3
  echo "## $ref + $run"
  start "$ref" ""
  start "$run" "$disable" "${dbo[@]}"
  healthy "$ref" && healthy "$run" || { stop "$ref" "$run"; return 1; }
  evaluate "$ref"
  evaluate "$run"
  stop "$ref" "$run"
}

pair off_a stock on_stock
if [ $((budget - SECONDS)) -lt 200 ]; then
  echo "## off_b + on_fix: skipped, $SECONDS s of a $budget s budget used"
else
  pair off_b "" on_fix
fi
runs=()
for name in off_a off_b on_stock on_fix; do
  compgen -G "$out/$name/*/samples_gsm8k_local_*.jsonl" > /dev/null && runs+=("$name")
done
echo "## lm_eval samples, ${runs[0]:-none} the reference"
(cd "$out" && python3 -m vllm_dsa_dbo.cli ab "${runs[@]}" --task gsm8k_local) > "$out/ab.md" 2>&1
cat "$out/ab.md"
echo "## worker lines"
for name in off_a on_stock off_b on_fix; do
  [ -f "$out/$name.log" ] || continue
  echo "$name: plugin $(grep -c 'vllm-dsa-dbo: .*keeps shared top-k per DBO microbatch' "$out/$name.log")," \
    "harness $(grep -c 'dsa_dbo_harness: .*microbatched' "$out/$name.log")"
  grep -h 'vllm-dsa-dbo: \|dsa_dbo_harness: ' "$out/$name.log" | cut -c1-300 | sort | uniq -c | head -6
  grep -hE 'Traceback|Error' "$out/$name.log" | grep -v '^W1130' | tail -3
done
echo "total $SECONDS s"
parts=(model)
for name in off_a on_stock off_b on_fix; do [ -d "$out/$name" ] && parts+=("$name"); done
tar -czf "$out/samples.tar.gz" -C "$out" "${parts[@]}" && (cd "$out" && rm -rf "${parts[@]}")
ls -la "$out"
