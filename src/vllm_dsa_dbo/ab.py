"""Question-by-question A/B of lm_eval runs, which lm_eval scores but does not pair.

A run is what `lm_eval --log_samples` wrote: its samples_<task>_<date>.jsonl, or the
--output_path folder holding it. Per filter, against the first run (the reference): the
questions right in both, lost (right there, wrong here), gained and wrong in both; each run's
accuracy with lm_eval's standard error; McNemar's z = (lost - gained) / sqrt(lost + gained), the
column upstream used to call a DBO-on run "the same" as DBO off, and McNemar's exact two-sided
p; and the number of questions whose generated text is identical to the reference's, the signal
where a random-weight model's accuracy is about 0.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path


class ABError(Exception):
    """Input that cannot be compared: a folder or file."""


@dataclass(frozen=True)
class Run:
    """Per filter, whether each question (doc id) was answered right; each question's
    output, and what identifies the question itself (by field, those the run carries)."""

    name: str
    correct: dict[str, dict[int, bool]]
    responses: dict[int, object]
    questions: dict[int, dict[str, str]]


@dataclass(frozen=True)
class Comparison:
    run: str
    filter: str
    accuracy: float
    stderr: float | None
    questions: int
    both_right: int | None = None
    lost: int | None = None
    gained: int | None = None
    both_wrong: int | None = None
    identical: int | None = None

    @property
    def mcnemar_z(self) -> float | None:
        if self.lost is None or self.gained is None:
            return None
        discordant = self.lost + self.gained
        return 0.0 if discordant == 0 else (self.lost - self.gained) / math.sqrt(discordant)

    @property
    def mcnemar_p(self) -> float | None:
        if self.lost is None or self.gained is None:
            return None
        return mcnemar_p(self.lost, self.gained)


def mcnemar_p(lost: int, gained: int) -> float:
    """McNemar's exact test: two-sided binomial test of the discordant pairs at 1/2. By hand,
    as scipy (stats.binomtest) is no dependency of vLLM."""
    n = lost + gained
    tail = sum(math.comb(n, k) for k in range(min(lost, gained) + 1))
    return min(1.0, 2 * tail / 2**n)


def read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ABError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ABError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def samples_file(run: Path, task: str) -> Path:
    """`run` itself, or the one samples_<task>_<date>.jsonl lm_eval wrote under it."""
    if run.is_file():
        if not run.name.startswith("samples_") or run.suffix != ".jsonl":
            raise ABError(f"{run} is not an lm_eval samples_<task>_<date>.jsonl file")
        return run
    if not run.is_dir():
        raise ABError(f"{run} is not a folder or a samples file")
    # lm_eval names it samples_<task>_<ISO date>; the date keeps gsm8k_cot out of gsm8k.
    name = re.compile(rf"samples_{re.escape(task)}_\d{{4}}-\d\d-\d\dT[^/]*\.jsonl")
    files = sorted(p for p in run.rglob("samples_*.jsonl") if name.fullmatch(p.name))
    if not files:
        raise ABError(f"{run}: no samples_{task}_<date>.jsonl (run lm_eval with --log_samples)")
    if len(files) > 1:
        raise ABError(
            f"{run} holds {len(files)} samples_{task}_*.jsonl files "
            f"({', '.join(str(f.relative_to(run)) for f in files)}), as a second lm_eval run "
            "into the same --output_path leaves them: give the folder of one run, or move "
            "the others away"
        )
    return files[0]


def load_runs(runs: list[Path], task: str, metric: str) -> list[Run]:
    """The runs, each a samples file of its own."""
    files = [samples_file(run, task) for run in runs]
    seen: dict[Path, Path] = {}
    for run, file in zip(runs, files):
        if file.resolve() in seen:
            raise ABError(
                f"{seen[file.resolve()]} and {run} are one run ({file.name}): give the "
                "samples of two lm_eval runs"
            )
        seen[file.resolve()] = run
    return [load_samples(file, str(run), metric) for run, file in zip(runs, files)]


def load_samples(path: Path, name: str, metric: str) -> Run:
    """A run from lm_eval's samples_<task>_<date>.jsonl (`resps` is the generated text)."""
    correct: dict[str, dict[int, bool]] = {}
    responses: dict[int, object] = {}
    questions: dict[int, dict[str, str]] = {}
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
            doc_id = sample["doc_id"]
            if not isinstance(doc_id, int) or isinstance(doc_id, bool):
                raise TypeError(f"doc_id {doc_id!r} is not a whole number")
            filter_name = sample.get("filter", "none")
            if not isinstance(filter_name, str):
                raise TypeError(f"filter {filter_name!r} is not a name")
            answers = correct.setdefault(filter_name, {})
            if doc_id in answers:
                raise ValueError(f"doc_id {doc_id} appears twice")
            answers[doc_id] = metric_value(sample[metric]) >= 1.0
            responses[doc_id] = sample["resps"]
            question = question_of(sample)
        except (ValueError, KeyError, TypeError) as e:
            raise ABError(f"{path}:{number}: not an lm_eval sample with {metric!r}: {e}") from None
        if questions.setdefault(doc_id, question) != question:
            raise ABError(f"{path}:{number}: doc_id {doc_id} holds another question than before")
    if not correct:
        raise ABError(f"{path}: no samples")
    return Run(name, correct, responses, questions)


def metric_value(value: object) -> float:
    """A per-sample metric; a count of right answers has no room for NaN, text or a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the metric is {value!r}, not a number")
    return value


def question_of(sample: dict) -> dict[str, str]:
    """What identifies a sample's question: lm_eval's doc_hash and the doc, where present."""
    fields = {"doc_hash": str(sample["doc_hash"])} if "doc_hash" in sample else {}
    if "doc" in sample:
        fields["doc"] = json.dumps(sample["doc"], sort_keys=True)
    return fields


def stderr(right: int, n: int) -> float | None:
    """lm_eval's mean_stderr of 0/1 values: sample standard deviation / sqrt(n)."""
    return None if n < 2 else math.sqrt(right * (n - right) / (n * n * (n - 1)))


def compare(runs: list[Run]) -> list[Comparison]:
    """The first run is the reference."""
    ref = runs[0]
    rows = []
    for run in runs:
        check_same_questions(ref, run)
        for filter_name, answers in sorted(run.correct.items()):
            n, right = len(answers), sum(answers.values())
            row = (run.name, filter_name, right / n, stderr(right, n), n)
            if run is ref:
                rows.append(Comparison(*row))
                continue
            base = ref.correct.get(filter_name)
            if base is None or base.keys() != answers.keys():
                raise ABError(
                    f"{run.name}: filter {filter_name!r} does not cover the same questions as "
                    f"{ref.name}"
                )
            pairs = [(base[q], answers[q]) for q in base]
            rows.append(
                Comparison(
                    *row,
                    both_right=pairs.count((True, True)),
                    lost=pairs.count((True, False)),
                    gained=pairs.count((False, True)),
                    both_wrong=pairs.count((False, False)),
                    identical=sum(run.responses[q] == ref.responses[q] for q in base),
                )
            )
    return rows


def check_same_questions(ref: Run, run: Run) -> None:
    """Runs compare question by question only if each doc id is the same question, by
    each field both runs carry for it."""
    if run.correct.keys() != ref.correct.keys():
        raise ABError(
            f"{run.name}: filters {sorted(run.correct)} are not {ref.name}'s {sorted(ref.correct)}"
        )
    differ, unchecked = [], 0
    for q, fields in run.questions.items():
        theirs = ref.questions.get(q, {})
        shared = fields.keys() & theirs.keys()
        unchecked += not shared
        if any(fields[f] != theirs[f] for f in shared):
            differ.append(q)
    if differ:
        raise ABError(
            f"{run.name}: {len(differ)} doc ids (first {min(differ)}) hold other questions "
            f"than in {ref.name} (their doc / doc_hash differ): compare runs of one task "
            "on the same questions"
        )
    if unchecked:
        print(
            f"note: {unchecked} doc ids of {run.name} share no doc or doc_hash field with "
            f"{ref.name}: not checked to be the same questions",
            file=sys.stderr,
        )


def table(rows: list[Comparison]) -> str:
    lines = [
        "| run | filter | accuracy ± stderr | both right / both wrong | lost / gained "
        "| McNemar z | exact p | identical responses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        accuracy = f"{r.accuracy:.3f} ± " + ("-" if r.stderr is None else f"{r.stderr:.3f}")
        if r.lost is None:
            lines.append(f"| {r.run} (reference) | {r.filter} | {accuracy} | - | - | - | - | - |")
        else:
            lines.append(
                f"| {r.run} | {r.filter} | {accuracy} | {r.both_right} / {r.both_wrong} "
                f"| {r.lost} / {r.gained} | {r.mcnemar_z:.1f} | {r.mcnemar_p:.3g} "
                f"| {r.identical} / {r.questions} |"
            )
    return "\n".join(lines)
