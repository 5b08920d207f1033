"""Engine cost of the fix under DBO on 2 GPUs: time per microbatched forward,
CUDA kernels and synchronizing calls in one, stock vs fix.

    validation/run_matrix.sh DIR perf_on_stock perf_on_fix perf_on_fix_b \\
        perf_on_stock_b perf_graph_on_stock perf_graph_on_fix    # on 2 GPUs, LANES=1
    (the control: perf_freq1_on_stock perf_freq1_on_fix perf_freq1_on_fix_b
    perf_freq1_on_stock_b, no followers, so stock is not corrupted)
    python bench/engine_step.py DIR [--json OUT.json]

The harness (`VLLM_DSA_DBO_HARNESS_MEASURE=1`) times every microbatched
forward of the generation in each worker between two device syncs, and runs
its 20th (a decode step) under the torch profiler with
`torch.cuda.set_sync_debug_mode("warn")`. In FULL_DECODE_ONLY mode a decode
forward is one graph replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PAIRS = (("V1 eager", "perf_on_stock", "perf_on_fix"),
         ("V1 eager, repeat", "perf_on_stock_b", "perf_on_fix_b"),
         ("V1 FULL_DECODE_ONLY graph replay", "perf_graph_on_stock", "perf_graph_on_fix"),
         ("V1 FULL_DECODE_ONLY graph replay, repeat", "perf_graph_on_stock_b", "perf_graph_on_fix_b"),
         ("V1 eager, index_topk_freq=1 (control)", "perf_freq1_on_stock", "perf_freq1_on_fix"),
         ("V1 eager, index_topk_freq=1 (control), repeat", "perf_freq1_on_stock_b", "perf_freq1_on_fix_b"))


def workers(run: dict) -> list[dict]:
    return [w for rank in run["ranks"] for w in rank["workers"]]


def summary(run: dict) -> dict:
    measured = [w["measured"] for w in workers(run)]
    seconds = [s for m in measured for s in m["seconds"]]
    profiles = [m["profile"] for m in measured]
    return {
        "fix_active": all(w["plugin_patched"] for w in workers(run)),
        "forwards_timed": len(seconds),
        "median_ms": 1e3 * statistics.median(seconds),
        "p10_ms": 1e3 * statistics.quantiles(seconds, n=10)[0],
        "min_ms": 1e3 * min(seconds),
        "worker_median_ms": [1e3 * statistics.median(m["seconds"]) for m in measured],
        "cuda_kernels": [p["cuda_kernels"] for p in profiles],
        "sync_warnings": [p["sync_warnings"] for p in profiles],
        "kernels_by_name": [p["kernels_by_name"] for p in profiles],
    }


def compare(stock: dict, fixed: dict) -> dict:
    s, f = summary(stock), summary(fixed)
    if s["fix_active"] or not f["fix_active"]:
        raise ValueError("the stock run must have the fix disabled and the fixed run enabled")
    return {
        "stock": {k: v for k, v in s.items() if k != "kernels_by_name"},
        "fix": {k: v for k, v in f.items() if k != "kernels_by_name"},
        "median_ratio": f["median_ms"] / s["median_ms"],
        "p10_ratio": f["p10_ms"] / s["p10_ms"],
        "same_kernels": s["kernels_by_name"] == f["kernels_by_name"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = {}
    print("| mode | forwards timed (stock / fix) | median ms (stock / fix) | median ratio "
          "| p10 ms (stock / fix) | p10 ratio | min ms (stock / fix) "
          "| CUDA kernels per profiled forward (stock / fix, per worker) | same kernels by name "
          "| synchronizing calls (stock / fix) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, stock_name, fix_name in PAIRS:
        paths = [args.runs / f"{n}.json" for n in (stock_name, fix_name)]
        if not all(p.exists() for p in paths):
            continue
        row = rows[mode] = compare(*(json.loads(p.read_text()) for p in paths))
        s, f = row["stock"], row["fix"]
        print(f"| {mode} | {s['forwards_timed']} / {f['forwards_timed']} "
              f"| {s['median_ms']:.3f} / {f['median_ms']:.3f} | {row['median_ratio']:.3f} "
              f"| {s['p10_ms']:.3f} / {f['p10_ms']:.3f} | {row['p10_ratio']:.3f} "
              f"| {s['min_ms']:.3f} / {f['min_ms']:.3f} | {s['cuda_kernels']} / "
              f"{f['cuda_kernels']} | {row['same_kernels']} | {s['sync_warnings']} / {f['sync_warnings']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
