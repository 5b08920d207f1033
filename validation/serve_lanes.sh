#!/usr/bin/env bash
# serve_table.sh in several lanes at once on one GPU, one device call: each lane its own ports
# and its arms in turn, every engine at SERVE_TABLE_GPU_UTIL (default 0.1) with a fixed KV
# cache (SERVE_TABLE_KV_BYTES, default 2 GiB), so that the lanes' profiles cannot starve each
# other. Lane N writes OUTPREFIX_N.tgz; each lane stops starting arms at SERVE_TABLE_BUDGET_S.
#   bash validation/serve_lanes.sh $OUT/ht ht "off_a off_b" "stock fix" "half_fix" ...
set -uo pipefail
prefix="${1:?usage: serve_lanes.sh OUTPREFIX ht|ll ARMS...}" mode="${2:?ht or ll}"
shift 2
[ $# -ge 1 ] && [ $# -le 9 ] || { echo "one to nine lanes, each a quoted list of arms"; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
export SERVE_TABLE_GPU_UTIL="${SERVE_TABLE_GPU_UTIL:-0.1}"
export SERVE_TABLE_KV_BYTES="${SERVE_TABLE_KV_BYTES:-2147483648}"
lane=0 pids=()
for arms in "$@"; do
  # shellcheck disable=SC2086 # a lane's arms are words
  SERVE_TABLE_LANE=$lane bash "$here/serve_table.sh" "${prefix}_$lane" "$mode" $arms \
    > "/tmp/serve_lane_$lane.out" 2>&1 &
  pids+=($!)
  lane=$((lane + 1))
  sleep 2  # the first lane takes the setup lock first
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for out in /tmp/serve_lane_*.out; do
  echo "### $out"
  grep -E "^## |: up after|rc=|strict-match|microbatched|exited|^\{" "$out" | cut -c1-300
done
exit $status
