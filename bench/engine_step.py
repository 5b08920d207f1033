"""Engine cost of the fix under DBO on 2 GPUs: time per microbatched forward,
CUDA kernels and synchronizing calls in one, stock vs fix.

    validation/run_matrix.sh DIR perf_on_stock perf_on_fix perf_on_fix_b \\
        perf_on_stock_b    # on 2 GPUs, LANES=1; likewise perf_graph_* and
                           # the control perf_freq1_* (no followers)
    python bench/engine_step.py DIR [--json OUT.json]

DeepEP sets: `run_matrix.sh DIR perf_ht_on_stock perf_ht_on_fix perf_ht_on_fix_b
perf_ht_on_stock_b` (and `perf_llf_*`), on one GPU or two; `perf_ht_off_a` is
DBO off with the fix, for the DBO speed-up.

The harness (`VLLM_DSA_DBO_HARNESS_MEASURE=1`) times every microbatched
forward of the generation in each worker between two device syncs, and runs
its 20th (a decode step) under the torch profiler with
`torch.cuda.set_sync_debug_mode("warn")`, and its 21st under a frame timer
that sums the product's own Python time in every thread. In FULL_DECODE_ONLY
mode a decode forward is one graph replay. Where a configuration ran twice per arm, the
second table sets the fix's ratio against the repeat agreement of each arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# Per configuration: run names of (stock, fix), then of their repeat.
CONFIGS = (
    ("V1 eager", ("perf_on_stock", "perf_on_fix"), ("perf_on_stock_b", "perf_on_fix_b")),
    (
        "V1 FULL_DECODE_ONLY graph replay",
        ("perf_graph_on_stock", "perf_graph_on_fix"),
        ("perf_graph_on_stock_b", "perf_graph_on_fix_b"),
    ),
    (
        "V1 eager, index_topk_freq=1 (control)",
        ("perf_freq1_on_stock", "perf_freq1_on_fix"),
        ("perf_freq1_on_stock_b", "perf_freq1_on_fix_b"),
    ),
    (
        "DeepEP HT eager",
        ("perf_ht_on_stock", "perf_ht_on_fix"),
        ("perf_ht_on_stock_b", "perf_ht_on_fix_b"),
    ),
    (
        "DeepEP LL FULL_DECODE_ONLY replay, fp8 KV",
        ("perf_llf_on_stock", "perf_llf_on_fix"),
        ("perf_llf_on_stock_b", "perf_llf_on_fix_b"),
    ),
)


def workers(run: dict) -> list[dict]:
    return [w for rank in run["ranks"] for w in rank["workers"]]


def seconds(run: dict) -> list[float]:
    return [s for w in workers(run) for s in w["measured"]["seconds"]]


def busiest_host_op(profile: dict) -> dict | None:
    """The profiled forward's host operator with the most time of its own."""
    ops = profile.get("host_ops_by_self_time")
    if not ops:
        return None
    return {
        "name": ops[0]["name"],
        "self_ms": ops[0]["self_cpu_us"] / 1e3,
        "listed_ops_self_ms": sum(o["self_cpu_us"] for o in ops) / 1e3,
    }


def fix_host_share(measured: dict) -> dict | None:
    """The product's own Python time in the frame-timed forward, as a share of the
    worker's median untimed forward: as read (an upper bound: the timer's hook runs in
    the frames it times) and with the hook's calibrated cost taken off (runs before the
    calibration have only the first); None where a run did not time its frames."""
    frames = measured.get("fix_frames")
    if frames is None:
        return None
    forward_us = 1e6 * statistics.median(measured["seconds"])
    corrected = frames.get("corrected_self_us")
    return {
        "read": frames["self_us"] / forward_us,
        "corrected": None if corrected is None else corrected / forward_us,
        "calls": frames["calls"],
        "self_us": frames["self_us"],
        "busiest": frames.get("busiest", []),
    }


def host_shares(runs: Path) -> dict[str, list[dict]]:
    """Per frame-timed run in `runs`, by name: `fix_host_share` of each worker."""
    shares = {}
    for path in sorted(runs.glob("*.json")):
        run = json.loads(path.read_text())
        if "ranks" not in run:
            continue
        per_worker = [fix_host_share(w["measured"]) for w in workers(run)]
        if None not in per_worker:
            shares[path.stem] = per_worker
    return shares


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.3f} %"


def summary(run: dict) -> dict:
    profiles = [w["measured"]["profile"] for w in workers(run)]
    timed = seconds(run)
    return {
        "fix_active": all(w["plugin_patched"] for w in workers(run)),
        "forwards_timed": len(timed),
        "median_ms": 1e3 * statistics.median(timed),
        "p10_ms": 1e3 * statistics.quantiles(timed, n=10)[0],
        "min_ms": 1e3 * min(timed),
        "worker_median_ms": [
            1e3 * statistics.median(w["measured"]["seconds"]) for w in workers(run)
        ],
        "cuda_kernels": [p["cuda_kernels"] for p in profiles],
        "sync_warnings": [p["sync_warnings"] for p in profiles],
        "busiest_host_op": [busiest_host_op(p) for p in profiles],
        "kernels_by_name": [p["kernels_by_name"] for p in profiles],
    }


def compare(stock: dict, fixed: dict) -> dict:
    s, f = summary(stock), summary(fixed)
    if s["fix_active"] or not f["fix_active"]:
        raise ValueError("the first run must be stock and the second the fix")
    return {
        "stock": {k: v for k, v in s.items() if k != "kernels_by_name"},
        "fix": {k: v for k, v in f.items() if k != "kernels_by_name"},
        "median_ratio": f["median_ms"] / s["median_ms"],
        "p10_ratio": f["p10_ms"] / s["p10_ms"],
        "same_kernels": s["kernels_by_name"] == f["kernels_by_name"],
    }


def repeats(first: tuple[dict, dict], second: tuple[dict, dict]) -> dict:
    """Each arm's repeat against its first run, and the fix against stock
    over all forwards of both runs of each arm."""

    def median(*runs: dict) -> float:
        return statistics.median(s for run in runs for s in seconds(run))

    (stock, fixed), (stock_b, fixed_b) = first, second
    return {
        "stock_repeat_ratio": median(stock_b) / median(stock),
        "fix_repeat_ratio": median(fixed_b) / median(fixed),
        "pooled_median_ratio": median(fixed, fixed_b) / median(stock, stock_b),
    }


def load(runs: Path, names: tuple[str, str]) -> tuple[dict, dict] | None:
    paths = [runs / f"{n}.json" for n in names]
    if not all(p.exists() for p in paths):
        return None
    return tuple(json.loads(p.read_text()) for p in paths)


def print_pairs(pairs: dict) -> None:
    """The stock-vs-fix timing table."""
    print(
        "| mode | forwards timed (stock / fix) | median ms (stock / fix) | median ratio "
        "| p10 ms (stock / fix) | p10 ratio | min ms (stock / fix) "
        "| CUDA kernels per profiled forward (stock / fix, per worker) | same kernels by name "
        "| synchronizing calls (stock / fix) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, row in pairs.items():
        s, f = row["stock"], row["fix"]
        print(
            f"| {mode} | {s['forwards_timed']} / {f['forwards_timed']} "
            f"| {s['median_ms']:.3f} / {f['median_ms']:.3f} | {row['median_ratio']:.3f} "
            f"| {s['p10_ms']:.3f} / {f['p10_ms']:.3f} | {row['p10_ratio']:.3f} "
            f"| {s['min_ms']:.3f} / {f['min_ms']:.3f} | {s['cuda_kernels']} / "
            f"{f['cuda_kernels']} | {row['same_kernels']} "
            f"| {s['sync_warnings']} / {f['sync_warnings']} |"
        )


def print_runs(column: str, cells: dict[str, str]) -> None:
    """A two-column table: one cell per run."""
    print(f"\n| run | {column} |")
    print("|---|---|")
    for name, cell in cells.items():
        print(f"| {name} | {cell} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    pairs, agreement = {}, {}
    for mode, first, second in CONFIGS:
        loaded = [load(args.runs, names) for names in (first, second)]
        for label, runs in zip((mode, f"{mode}, repeat"), loaded):
            if runs is not None:
                pairs[label] = compare(*runs)
        if None not in loaded:
            agreement[mode] = repeats(*loaded)
    if pairs:
        print_pairs(pairs)
    if agreement:
        print(
            "\n| mode | stock repeat / stock | fix repeat / fix | fix / stock, both runs pooled |"
        )
        print("|---|---|---|---|")
        for mode, row in agreement.items():
            print(
                f"| {mode} | {row['stock_repeat_ratio']:.3f} | {row['fix_repeat_ratio']:.3f} "
                f"| {row['pooled_median_ratio']:.3f} |"
            )
    busiest = [
        (mode, arm, row[arm]["busiest_host_op"])
        for mode, row in pairs.items()
        for arm in ("stock", "fix")
        if all(row[arm]["busiest_host_op"])
    ]
    if busiest:
        print(
            "\n| mode | arm | busiest host operator of the profiled forward (per worker) "
            "| its own ms | own ms of the 25 busiest |"
        )
        print("|---|---|---|---|---|")
        for mode, arm, ops in busiest:
            names = ", ".join(f"`{n}`" for n in dict.fromkeys(op["name"] for op in ops))
            own = " / ".join(f"{op['self_ms']:.1f}" for op in ops)
            listed = " / ".join(f"{op['listed_ops_self_ms']:.1f}" for op in ops)
            print(f"| {mode} | {arm} | {names} | {own} | {listed} |")
    shares = host_shares(args.runs)
    if shares:
        print_runs(
            "the product's own Python time in the frame-timed forward, share of a median "
            "forward, as read (an upper bound) and, in brackets, with the hook's cost taken off "
            "(frames, µs as read), per worker",
            {
                name: " / ".join(
                    f"{percent(w['read'])} [{percent(w['corrected'])}] "
                    f"({w['calls']}, {w['self_us']:.0f})"
                    for w in per_worker
                )
                for name, per_worker in shares.items()
            },
        )
    listed = {name: w[0]["busiest"] for name, w in shares.items() if w[0]["busiest"]}
    if listed:
        print_runs(
            "the product's functions in the frame-timed forward of worker 0: calls "
            "(C calls, Python calls they make), µs as read",
            {
                name: "; ".join(
                    f"`{f['function']}` {f['calls']} ({f['c_calls']}, {f['py_calls']}), "
                    f"{f['self_us']:.0f}"
                    for f in busiest
                )
                for name, busiest in listed.items()
            },
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"pairs": pairs, "repeat_agreement": agreement, "host_shares": shares}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
