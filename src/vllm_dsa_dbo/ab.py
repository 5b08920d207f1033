"""Question-by-question A/B of lm_eval runs (`lm_eval --log_samples` folders).

Accuracy per run and filter, and against a reference run the questions lost
(right there, wrong here) and gained, with McNemar's z = (lost - gained) /
sqrt(lost + gained): the columns upstream used to call a DBO-on run "the same"
as DBO off when z is inside noise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


class SamplesError(Exception):
    """A folder holds no usable lm_eval samples."""


@dataclass(frozen=True)
class Comparison:
    run: str
    filter: str
    accuracy: float
    lost: int | None = None
    gained: int | None = None

    @property
    def mcnemar_z(self) -> float | None:
        if self.lost is None or self.gained is None:
            return None
        discordant = self.lost + self.gained
        return 0.0 if discordant == 0 else (self.lost - self.gained) / math.sqrt(discordant)


def load_samples(folder: Path, task: str, metric: str) -> dict[str, dict[int, bool]]:
    """Per filter, whether each question (doc_id) was answered right."""
    files = sorted(folder.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SamplesError(f"{folder}: no samples_{task}_*.jsonl (run lm_eval with --log_samples)")
    results: dict[str, dict[int, bool]] = {}
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
                correct = float(sample[metric]) >= 1.0
                results.setdefault(sample.get("filter", "none"), {})[int(sample["doc_id"])] = correct
            except (ValueError, KeyError, TypeError) as e:
                raise SamplesError(f"{path}:{number}: not an lm_eval sample with {metric!r}: {e}") from None
    return results


def compare(reference: Path, runs: list[Path], task: str, metric: str) -> list[Comparison]:
    ref = load_samples(reference, task, metric)
    rows = []
    for path in [reference, *runs]:
        samples = ref if path == reference else load_samples(path, task, metric)
        for filter_name, answers in sorted(samples.items()):
            accuracy = sum(answers.values()) / len(answers)
            if path == reference:
                rows.append(Comparison(str(path), filter_name, accuracy))
                continue
            base = ref.get(filter_name)
            if base is None or base.keys() != answers.keys():
                raise SamplesError(
                    f"{path}: filter {filter_name!r} does not cover the same questions as "
                    f"{reference}"
                )
            lost = sum(base[q] and not answers[q] for q in base)
            gained = sum(answers[q] and not base[q] for q in base)
            rows.append(Comparison(str(path), filter_name, accuracy, lost, gained))
    return rows


def table(rows: list[Comparison]) -> str:
    lines = [
        "| run | filter | accuracy | lost / gained vs reference | McNemar z |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r.lost is None:
            lines.append(f"| {r.run} (reference) | {r.filter} | {r.accuracy:.3f} | - | - |")
        else:
            lines.append(
                f"| {r.run} | {r.filter} | {r.accuracy:.3f} | {r.lost} / {r.gained} "
                f"| {r.mcnemar_z:.1f} |"
            )
    return "\n".join(lines)
