#!/bin/bash
# CPU-seconds the whole machine spent while the suite ran (machine otherwise idle).
read -r _ u n s i w q sq st _ < /proc/stat; t0=$(date +%s.%N); b0=$((u+n+s+q+sq)); i0=$((i+w))
CI=true .venv/bin/python -m pytest -q -p no:cacheprovider "$@" > "${LOG:-pytest.log}" 2>&1; rc=$?
read -r _ u n s i w q sq st _ < /proc/stat; t1=$(date +%s.%N); b1=$((u+n+s+q+sq)); i1=$((i+w))
hz=$(getconf CLK_TCK)
echo "rc=$rc wall=$(echo "$t1-$t0" | bc) busy_cpu_s=$(( (b1-b0)/hz )) idle_cpu_s=$(( (i1-i0)/hz ))" | tee "${LOG:-pytest.log}.cpu"
