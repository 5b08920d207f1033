"""The validation table from a folder of harness runs.

    python -m dsa_dbo_harness.report RUNS_DIR [--json OUT.json]

Row names are run names of `validation/run_matrix.sh` (file stems in RUNS_DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsa_dbo_harness.compare import compare, microbatched

# (section, label, reference run, compared run)
ROWS = [
    ("noise floor", "DBO off vs DBO off (second run, fix disabled)", "off_a", "off_stock"),
    ("V1 eager", "DBO on, stock", "off_a", "on_stock"),
    ("V1 eager", "DBO on, with the fix", "off_a", "on_fix"),
    ("V1 eager", "DBO on, stock (repeat)", "off_a", "mem/on_stock"),
    ("V1 eager", "DBO on, with the fix (repeat)", "off_a", "mem/on_fix"),
    ("V2 eager", "DBO on, stock", "v2_off", "v2_on_stock"),
    ("V2 eager", "DBO on, with the fix", "v2_off", "v2_on_fix"),
    ("V1 FULL_DECODE_ONLY graphs", "DBO on, stock", "graph_off", "graph_on_stock"),
    ("V1 FULL_DECODE_ONLY graphs", "DBO on, with the fix", "graph_off", "graph_on_fix"),
    ("V1 eager, DBO on prefill steps only", "stock", "off_a", "prefill_on_stock"),
    ("V1 eager, DBO on prefill steps only", "with the fix", "off_a", "prefill_on_fix"),
    ("control: index_topk_freq=1", "DBO on, stock", "freq1_off", "freq1_on_stock"),
    ("control: index_topk_freq=1", "DBO on, with the fix", "freq1_off", "freq1_on_fix"),
    ("control: index_topk_freq=1", "DBO on, stock (repeat)", "freq1_off", "mem/freq1_on_stock"),
    (
        "control: index_topk_freq=1",
        "DBO on, with the fix (repeat)",
        "freq1_off",
        "mem/freq1_on_fix",
    ),
    (
        "HYV4 (hy_v4/nvidia), V1 eager",
        "DBO off vs DBO off (second run, fix disabled)",
        "hy_off",
        "hy_off_b",
    ),
    ("HYV4 (hy_v4/nvidia), V1 eager", "DBO on, stock", "hy_off", "hy_on_stock"),
    ("HYV4 (hy_v4/nvidia), V1 eager", "DBO on, with the fix", "hy_off", "hy_on_fix"),
    (
        "deepseek_v2 path, eager",
        "DBO off vs DBO off (second run, fix disabled)",
        "dsv2e_off",
        "dsv2e_off_b",
    ),
    ("deepseek_v2 path, eager", "DBO on, stock", "dsv2e_off", "dsv2e_on_stock"),
    ("deepseek_v2 path, eager", "DBO on, with the fix", "dsv2e_off", "dsv2e_on_fix"),
    (
        "deepseek_v2 path, compiled, no CUDA graphs",
        "DBO off vs DBO off (second run, fix disabled)",
        "dsv2_off",
        "dsv2_off_b",
    ),
    ("deepseek_v2 path, compiled, no CUDA graphs", "DBO on, stock", "dsv2_off", "dsv2_on_stock"),
    (
        "deepseek_v2 path, compiled, no CUDA graphs",
        "DBO on, with the fix",
        "dsv2_off",
        "dsv2_on_fix",
    ),
    (
        "deepseek_v2 path, compiled, FULL_DECODE_ONLY graphs",
        "DBO on, stock",
        "dsv2_graph_off",
        "dsv2_graph_on_stock",
    ),
    (
        "deepseek_v2 path, compiled, FULL_DECODE_ONLY graphs",
        "DBO on, with the fix",
        "dsv2_graph_off",
        "dsv2_graph_on_fix",
    ),
    (
        "V1 eager, 120 tokens",
        "DBO off vs DBO off (second run, fix disabled)",
        "chk_off",
        "chk_off_b",
    ),
    ("V1 eager, 120 tokens", "DBO on, stock, checker on", "chk_off", "chk_on_stock"),
    ("V1 eager, 120 tokens", "DBO on, with the fix, checker on", "chk_off", "chk_on_fix"),
    ("V1 eager, 120 tokens", "DBO on, stock, timed", "chk_off", "perf_on_stock"),
    ("V1 eager, 120 tokens", "DBO on, with the fix, timed", "chk_off", "perf_on_fix"),
]


# Isolation-checker runs (VLLM_DSA_DBO_CHECK=audit): (label, run)
CHECK_ROWS = [
    ("V1 eager, DBO off", "chk_off"),
    ("V1 eager, DBO off, fix disabled", "chk_off_b"),
    ("V1 eager, DBO on, stock", "chk_on_stock"),
    ("V1 eager, DBO on, with the fix", "chk_on_fix"),
    ("V1 FULL_DECODE_ONLY graphs (checked at capture), DBO on, stock", "chk_graph_on_stock"),
    ("V1 FULL_DECODE_ONLY graphs (checked at capture), DBO on, with the fix", "chk_graph_on_fix"),
]


def load(runs: Path, name: str) -> dict:
    return json.loads((runs / f"{name}.json").read_text())


def workers(run: dict) -> list[dict]:
    return [w for rank in run["ranks"] for w in rank["workers"]]


def build(runs: Path) -> list[dict]:
    table = []
    for section, label, ref, name in ROWS:
        if not (runs / f"{name}.json").exists():
            continue
        run = load(runs, name)
        row = {"section": section, "label": label, "reference": ref, "run": name}
        row.update(compare(load(runs, ref), run))
        row["fix_active"] = all(w["plugin_patched"] for w in workers(run))
        row["microbatched_forwards_per_worker"] = microbatched(run)
        row["ubatch_topk_bytes_per_worker"] = [w["ubatch_topk_bytes"] for w in workers(run)]
        row["num_gpu_blocks"] = [w["num_gpu_blocks"] for w in workers(run)]
        table.append(row)
    return table


def build_checks(runs: Path) -> list[dict]:
    table = []
    for label, name in CHECK_ROWS:
        if not (runs / f"{name}.json").exists():
            continue
        run = load(runs, name)
        checks = [w["isolation_check"] for w in workers(run)]
        table.append(
            {
                "label": label,
                "run": name,
                "fix_active": all(w["plugin_patched"] for w in workers(run)),
                "microbatched_forwards_per_worker": microbatched(run),
                "checked_reads_per_worker": [c["checked_reads"] for c in checks],
                "violations_per_worker": [c["violations"] for c in checks],
                "violating_pairs": sorted({p for c in checks for p in c["violating_pairs"]}),
            }
        )
    return table


def markdown_checks(table: list[dict]) -> str:
    lines = [
        "| run | microbatched forwards / worker (generation) | checked reads / worker "
        "| violations / worker | distinct (writer, reader, state) |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['label']} (`{r['run']}`) | {min(r['microbatched_forwards_per_worker'])} "
            f"| {', '.join(map(str, r['checked_reads_per_worker']))} "
            f"| {', '.join(map(str, r['violations_per_worker']))} | {len(r['violating_pairs'])} |"
        )
    return "\n".join(lines)


def markdown(table: list[dict]) -> str:
    lines = [
        "| mode | run (vs reference) | identical | mean first diff | differ at token 0 "
        "| median abs dlogprob token 0 | token-0 logprob moved > 0.02 | mean abs dlogprob token 0 "
        "| microbatched forwards / worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['section']} | {r['label']} (`{r['run']}` vs `{r['reference']}`) "
            f"| {r['identical']}/{r['prompts']} | {r['mean_first_diff']:.1f} "
            f"| {r['differ_at_token0']} | {r['median_abs_dlogprob_token0']:.5f} "
            f"| {r['token0_logprob_moved']} | {r['mean_abs_dlogprob_token0']:.4f} "
            f"| {min(r['microbatched_forwards_per_worker'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    table, checks = build(args.runs), build_checks(args.runs)
    if args.json:
        args.json.write_text(json.dumps({"outputs": table, "isolation_checks": checks}, indent=1))
    print(markdown(table))
    if checks:
        print()
        print(markdown_checks(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
