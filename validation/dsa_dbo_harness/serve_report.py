"""What `validation/serve_table.sh` wrote, read back: per arm, lm_eval's graded answers and each
worker's harness counts; and issue 28's table from them.

    python -m dsa_dbo_harness.serve_report OUTDIR.tgz[:OUTDIR2.tgz ...]
    python -m dsa_dbo_harness.serve_report --record OUTDIR ARM MODE   # ARM.json, by serve_table.sh

Each arm is compared with its DBO-off run: `off_a`, or for the `index_topk_freq=1` arms `f1_off`
where the table has it (else `off_a`: the control's logits equal the model's, a CPU test checks).
The MTP arms are compared with `off_a` too: greedy speculative decoding keeps the model's tokens.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from dsa_dbo_harness.run import RECORDED_ENV
from vllm_dsa_dbo.ab import compare, load_runs, read_text, samples_file

TASK, FILTER = "kv_lookup", "strict-match"
ARMS = (
    "off_a",
    "off_b",
    "stock",
    "fix",
    "stock_check",
    "fix_check",
    "f1_off",
    "f1_stock",
    "tree_off",
    "tree_fix",
    "tree_plugin",
    "half_fix",
    "mtp_off",
    "mtp_stock",
    "mtp_fix",
    "mtp3_off",
    "mtp3_off_b",
    "mtp3_fix",
)
# What each worker's last harness line counts (HARNESS_LINE's groups, in order).
WORKER_COUNTS = (
    "microbatched_forwards",
    "forwards",
    "checked_reads",
    "bad_reads",
    "past_workspace_steps",
)
HARNESS_LINE = re.compile(
    r"dsa_dbo_harness: (\d+) microbatched forwards(?: of (\d+))?"
    r"(?:; checker (\d+) reads, (\d+) bad(?:, (\d+) steps past the workspace)?)?"
)
# What the same line names since vLLM 0.34.0's harness port: the runner and the release.
RUNNER_LINE = re.compile(r"dsa_dbo_harness: .*?; (V1 runner|Model Runner V2), vLLM (\S+?)[;\s]")
WORKER_LINE = re.compile(r"dsa_dbo_harness: worker on (V1 runner|Model Runner V2), vLLM (\S+)")
# vLLM's figure for the memory a model took at load (the plugin's state included), and the
# plugin's own count of the bytes it allocated.
LOADING_LINE = re.compile(r"Model loading took (\S+) GiB memory")
PLUGIN_LINE = re.compile(r"keeps shared top-k per DBO microbatch: .*?, ([\d,]+) bytes")
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}


def merge(outputs: str, into: Path) -> Path:
    """The arms of every serve_table.sh output in `outputs` (`:`-separated OUTDIR.tgz files or
    the folders they unpack to) in one folder, `into`."""
    for path in map(Path, outputs.split(os.pathsep)):
        if path.is_file():
            unpacked = Path(tempfile.mkdtemp(dir=into.parent))
            with tarfile.open(path) as archive:
                archive.extractall(unpacked, filter="data")
            (path,) = unpacked.iterdir()
        shutil.copytree(path, into, dirs_exist_ok=True)
    return into


def reference_of(table: Path, name: str) -> str:
    return "f1_off" if name.startswith("f1_") and (table / "f1_off").is_dir() else "off_a"


def answers(table: Path, name: str) -> dict[int, str]:
    """Per question, the answer lm_eval's strict-match filter took from `name`'s completion."""
    rows = map(json.loads, read_text(samples_file(table / name, TASK)).splitlines())
    return {row["doc_id"]: row["filtered_resps"][0] for row in rows if row["filter"] == FILTER}


def agreeing(run: dict[int, str], reference: dict[int, str]) -> int:
    """How many of `reference`'s questions `run` answered the same."""
    assert run.keys() == reference.keys(), "the runs answered different questions"
    return sum(run[q] == reference[q] for q in reference)


def harness_counts(table: Path, name: str) -> list[dict[str, int | None]]:
    """Per rank, the last WORKER_COUNTS its worker logged, by name; ranks whose worker logged
    no microbatched forward are left out."""
    counts = []
    for log in (table / f"{name}.rank{rank}.log" for rank in (0, 1)):
        found = HARNESS_LINE.findall(log.read_text()) if log.is_file() else []
        if found:
            counts.append(dict(zip(WORKER_COUNTS, (int(v) if v else None for v in found[-1]))))
    return counts


def runners(table: Path, name: str) -> list[tuple[str, str]]:
    """Per rank, the (runner, vLLM version) its worker named, where it did."""
    found = []
    for log in (table / f"{name}.rank{rank}.log" for rank in (0, 1)):
        text = log.read_text() if log.is_file() else ""
        named = WORKER_LINE.findall(text) or RUNNER_LINE.findall(text)
        if named:
            found.append(named[-1])
    return found


def memory(table: Path, name: str) -> list[dict[str, float | int | None]]:
    """Per rank, vLLM's model-loading GiB and the bytes the plugin allocated (None: no line)."""
    found = []
    for log in (table / f"{name}.rank{rank}.log" for rank in (0, 1)):
        text = log.read_text() if log.is_file() else ""
        loading, plugin = LOADING_LINE.findall(text), PLUGIN_LINE.findall(text)
        found.append(
            {
                "model_loading_gib": float(loading[-1]) if loading else None,
                "plugin_bytes": int(plugin[-1].replace(",", "")) if plugin else None,
            }
        )
    return found


def spec_decode(table: Path, name: str) -> dict[str, float] | None:
    """Speculative decoding's counters from the arm's /metrics (both engines), None without."""
    metrics = table / f"{name}.metrics.txt"
    if not metrics.is_file():
        return None
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    seen = False
    for line in metrics.read_text().splitlines():
        for key, counter in SPEC_COUNTERS.items():
            if line.startswith(counter + "{") or line.startswith(counter + " "):
                totals[key] += float(line.rsplit(" ", 1)[1])
                seen = True
    if not seen:
        return None
    drafted = totals["draft_tokens"]
    return {**totals, "acceptance": totals["accepted_tokens"] / drafted if drafted else None}


def record(table: Path, name: str, mode: str) -> dict:
    """What serve_table.sh keeps of one arm as ARM.json."""
    workers = harness_counts(table, name)
    named = runners(table, name)
    return {
        "arm": name,
        "mode": mode,
        "vllm_version": sorted({version for _, version in named}) or None,
        "runner": sorted({runner for runner, _ in named}) or None,
        "workers": workers,
        "spec_decode": spec_decode(table, name),
        "memory": memory(table, name),
        # What serve_table.sh exported for every arm: the GPUs both ranks ran on, the vLLM
        # checks the harness lifted (VLLM_DSA_DBO_HARNESS_GATES=0: none), DeepGEMM off.
        "env": {
            k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", *RECORDED_ENV) if k in os.environ
        },
    }


def report(table: Path) -> str:
    lines = [
        "| arm | accuracy ± stderr | answers equal to DBO off | against | lost / gained "
        "| McNemar p "
        "| microbatched forwards per worker | checker: bad of checked reads per worker "
        "| steps past the workspace per worker "
        "| runner, vLLM | draft acceptance | model loading GiB (plugin bytes) per worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in (a for a in ARMS if (table / a).is_dir()):
        reference = reference_of(table, name)
        if name == reference:
            (row,) = [
                r
                for r in compare(load_runs([table / name], TASK, "exact_match"))
                if r.filter == FILTER
            ]
            agree = against = lost = p = "-"
        else:
            runs = load_runs([table / reference, table / name], TASK, "exact_match")
            _, row = [r for r in compare(runs) if r.filter == FILTER]
            same = agreeing(answers(table, name), answers(table, reference))
            agree, against = f"{same} / {row.questions}", reference
            lost, p = f"{row.lost} / {row.gained}", f"{row.mcnemar_p:.3g}"
        counts = harness_counts(table, name)
        forwards = (
            ", ".join(f"{c['microbatched_forwards']} of {c['forwards']}" for c in counts) or "-"
        )
        checked = (
            ", ".join(
                f"{c['bad_reads']} of {c['checked_reads']}"
                for c in counts
                if c["checked_reads"] is not None
            )
            or "-"
        )
        past = (
            ", ".join(
                str(c["past_workspace_steps"])
                for c in counts
                if c["past_workspace_steps"] is not None
            )
            or "-"
        )
        named = ", ".join(sorted({f"{r}, {v}" for r, v in runners(table, name)})) or "-"
        spec = spec_decode(table, name)
        accepted = (
            "-"
            if spec is None or spec["acceptance"] is None
            else f"{spec['acceptance']:.3f} ({spec['accepted_tokens']:.0f} of "
            f"{spec['draft_tokens']:.0f})"
        )
        loaded = ", ".join(
            f"{m['model_loading_gib']} ({m['plugin_bytes'] or 0:,})"
            for m in memory(table, name)
            if m["model_loading_gib"] is not None
        )
        lines.append(
            f"| {name} | {row.accuracy:.3f} ± {row.stderr:.3f} | {agree} | {against} | {lost} "
            f"| {p} | {forwards} | {checked} | {past} | {named} | {accepted} | {loaded or '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "--record":
        print(json.dumps(record(Path(argv[1]), argv[2], argv[3])))
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        print(report(merge(argv[0], Path(tmp) / "table")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
