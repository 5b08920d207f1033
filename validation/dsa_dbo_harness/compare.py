"""Compare greedy runs prompt by prompt (the upstream long-prompt columns).

    python -m dsa_dbo_harness.compare REF.json RUN.json [RUN.json ...]
    python -m dsa_dbo_harness.compare --families DIR
        (every PREFIX_off_a/_off_b/_on_stock/_on_fix set in DIR)
    python -m dsa_dbo_harness.compare --pairs DIR
        (every PREFIX_on_stock/_on_fix pair in DIR, by the isolation checker: the
        stock run (VLLM_DSA_DBO_DISABLE=stock) must read across microbatches and the
        fix must not, microbatching; exit 1 otherwise)

Token-0 logprobs move in steps of one bf16 logit rounding (about 0.0078 or
0.0156 here), so beside the upstream median this also counts prompts whose
token-0 logprob moved by more than 0.02, and the mean move.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def samples(run: dict) -> list[dict]:
    return [s for rank in run["ranks"] for s in rank["samples"]]


LOGPROB_STEP = 0.02


def compare(reference: dict, run: dict) -> dict:
    ref, other = samples(reference), samples(run)
    if [s["prompt_len"] for s in ref] != [s["prompt_len"] for s in other]:
        raise ValueError("runs used different prompts")
    first_diffs, lp0 = [], []
    for a, b in zip(ref, other):
        diff = next(
            (i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
            len(a["tokens"]),
        )
        first_diffs.append(diff)
        lp0.append(abs(a["logprobs"][0] - b["logprobs"][0]))
    length = len(ref[0]["tokens"])
    return {
        "prompts": len(ref),
        "identical": sum(d == length for d in first_diffs),
        "mean_first_diff": statistics.mean(first_diffs),
        "differ_at_token0": sum(d == 0 for d in first_diffs),
        "median_abs_dlogprob_token0": statistics.median(lp0),
        "mean_abs_dlogprob_token0": statistics.mean(lp0),
        "token0_logprob_moved": sum(d > LOGPROB_STEP for d in lp0),
    }


def microbatched(run: dict) -> list[int]:
    """Microbatched forwards per worker during generation: eager, captured and
    replayed (V1 counts them at the wrapper; V2 only enters contexts eagerly)."""
    counts = [w["counts_during_generate"] for rank in run["ranks"] for w in rank["workers"]]
    return [c.get("ubatched_calls", c.get("ubatch0_forwards", 0)) for c in counts]


def violations(run: dict) -> int | None:
    checks = [w["isolation_check"] for rank in run["ranks"] for w in rank["workers"]]
    return None if None in checks else sum(c["violations"] for c in checks)


def family(runs: Path, prefix: str) -> dict:
    """A run set against its first DBO-off run: the floor, stock and the fix."""
    loaded = {
        p.stem[len(prefix) + 1 :]: json.loads(p.read_text()) for p in runs.glob(f"{prefix}_*.json")
    }
    reference = loaded.get("off_a", loaded.get("off"))
    rows = {}
    for name in ("off_b", "on_stock", "on_fix"):
        if name in loaded and reference is not None:
            run = loaded[name]
            rows[name] = {
                **compare(reference, run),
                "violations": violations(run),
                "microbatched": microbatched(run),
                "plugin_patched": sorted(
                    {w["plugin_patched"] for r in run["ranks"] for w in r["workers"]}
                ),
            }
    any_run = next(iter(loaded.values()))
    return {
        "family": prefix,
        "gpu_count": any_run.get("gpu_count"),
        "harness_gates": any_run.get("harness_gates"),
        "attention_backends": any_run.get("attention_backends"),
        "rows": rows,
    }


def checker_pair(runs: Path, prefix: str) -> dict:
    """A stock / fix pair's checker counts; `holds` where stock read badly and the fix did not.

    The plugin's own patches show in `plugin_patched` on a released vLLM only: in a tree
    carrying the upstream change the state is vLLM's, so the arms go by VLLM_DSA_DBO_DISABLE."""
    row: dict = {"pair": prefix}
    for arm in ("stock", "fix"):
        path = runs / f"{prefix}_on_{arm}.json"
        if not path.exists():
            row[arm] = None
            continue
        run = json.loads(path.read_text())
        workers = [w for rank in run["ranks"] for w in rank["workers"]]
        checks = [w["isolation_check"] for w in workers]
        row[arm] = {
            "vllm": run["vllm"],
            "vllm_path": run.get("vllm_path"),
            "fix_disabled_env": run["fix_disabled_env"],
            "runners": run["runners"],
            "mode": run["args"]["mode"],
            "all2all": run["args"]["all2all"],
            "attention_backends": run["attention_backends"],
            "plugin_patched": sorted({w["plugin_patched"] for w in workers}),
            "microbatched": microbatched(run),
            "graph_captures": [w["counts"].get("graph_captures", 0) for w in workers],
            "graph_replays": [w["counts"].get("graph_replays", 0) for w in workers],
            "traced_ubatch0_groups": [w.get("traced_ubatch0_groups", 0) for w in workers],
            "checked_reads": None if None in checks else [c["checked_reads"] for c in checks],
            "violations": violations(run),
        }
    stock, fix = row["stock"], row["fix"]
    row["holds"] = bool(
        stock
        and fix
        and stock["fix_disabled_env"] == "stock"
        and fix["fix_disabled_env"] == ""
        and (stock["violations"] or 0) > 0
        and fix["violations"] == 0
        and min(fix["microbatched"]) > 0
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reference", type=Path)
    parser.add_argument("runs", type=Path, nargs="*")
    parser.add_argument("--families", action="store_true", help="REFERENCE is a folder of runs")
    parser.add_argument("--pairs", action="store_true", help="REFERENCE is a folder of runs")
    args = parser.parse_args(argv)
    if args.pairs:
        names = sorted(p.stem for p in args.reference.glob("*_on_*.json"))
        rows = [
            checker_pair(args.reference, prefix)
            for prefix in dict.fromkeys(n.rsplit("_on_", 1)[0] for n in names)
        ]
        for row in rows:
            print(json.dumps(row))
        return 0 if rows and all(row["holds"] for row in rows) else 1
    if args.families:
        stems = sorted(p.stem for p in args.reference.glob("*_off*.json"))
        for prefix in dict.fromkeys(s.rsplit("_off", 1)[0] for s in stems):
            print(json.dumps(family(args.reference, prefix)))
        return 0
    reference = json.loads(args.reference.read_text())
    for path in args.runs:
        row = compare(reference, json.loads(path.read_text()))
        print(f"{args.reference.name} vs {path.name}: {json.dumps(row)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
