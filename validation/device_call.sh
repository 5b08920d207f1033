#!/usr/bin/env bash
# One device call: run_matrix.sh NAME ... into $OUT/SET, the run-set comparisons
# (families.jsonl), then one tarball $OUT/SET.tgz (a call returns at most 8 files).
#   bash validation/device_call.sh SET SECONDS NAME ...
set -uo pipefail
set_name="$1" budget="$2"; shift 2
here="$(cd "$(dirname "$0")" && pwd)"
dir="$OUT/$set_name"; mkdir -p "$dir"
timeout "$budget" bash "$here/run_matrix.sh" "$dir" "$@" 2>&1 | tee "$dir/matrix.log"
. /tmp/gpu/env.sh
python -m dsa_dbo_harness.compare --families "$dir" > "$dir/families.jsonl"
cut -c1-1200 "$dir/families.jsonl"
tar -czf "$OUT/$set_name.tgz" -C "$OUT" "$set_name" && rm -rf "$dir"
