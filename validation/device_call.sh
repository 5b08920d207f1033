#!/usr/bin/env bash
# One device call: run_matrix.sh NAME ... into $OUT/SET, the run-set comparisons
# (families.jsonl), then one tarball $OUT/SET.tgz (a call returns at most 8 files).
# The first NAME runs alone: if it writes no result, the rest are skipped.
#   bash validation/device_call.sh SET SECONDS NAME ...
set -uo pipefail
set_name="$1" budget="$2"; shift 2
here="$(cd "$(dirname "$0")" && pwd)"
dir="$OUT/$set_name"; mkdir -p "$dir"
start=$SECONDS
bash "$here/run_matrix.sh" "$dir" "$1" 2>&1 | tee "$dir/matrix.log"
if [ -f "$dir/$1.json" ] && [ $# -gt 1 ]; then
  shift
  timeout $((budget - SECONDS + start)) bash "$here/run_matrix.sh" "$dir" "$@" 2>&1 | tee -a "$dir/matrix.log"
else
  tail -40 "$dir/$1.log"
fi
. /tmp/gpu/env.sh
python -m dsa_dbo_harness.compare --families "$dir" > "$dir/families.jsonl"
cut -c1-1200 "$dir/families.jsonl"
tar -czf "$OUT/$set_name.tgz" -C "$OUT" "$set_name" && rm -rf "$dir"
