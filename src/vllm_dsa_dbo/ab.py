"""Question-by-question A/B of greedy GSM8K-style runs.

Accuracy per run and filter, and against a reference run the questions lost
(right there, wrong here) and gained, with McNemar's z = (lost - gained) /
sqrt(lost + gained): the columns upstream used to call a DBO-on run "the same"
as DBO off when z is inside noise. With a random-weight model accuracy is
about 0, so the number of questions whose generated text is identical to the
reference's is the signal there.

A run is an `lm_eval --log_samples` folder, or is made here by sending each
question to an OpenAI-compatible endpoint as lm_eval's gsm8k task would
(same prompt, greedy, stop at "Question:") and scoring it the same way.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm.contrib.concurrent import thread_map

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED = [",", r"\$", r"(?s).*#### ", r"\.$"]
# lm_eval's target is the text after "#### ", which only a number can match.
NUMBER = re.compile(r"-?[0-9.]*[0-9][0-9.]*")
STOP = "Question:"
# lm_eval's aiohttp client ignores proxy variables too; endpoints are reached directly.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ABError(Exception):
    """Input that cannot be compared: a folder, file or endpoint."""


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
    questions: int
    lost: int | None = None
    gained: int | None = None
    identical: int | None = None

    @property
    def mcnemar_z(self) -> float | None:
        if self.lost is None or self.gained is None:
            return None
        discordant = self.lost + self.gained
        return 0.0 if discordant == 0 else (self.lost - self.gained) / math.sqrt(discordant)


def read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ABError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ABError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def samples_file(folder: Path, task: str) -> Path:
    """The one samples_<task>_<date>.jsonl lm_eval wrote under `folder`."""
    # lm_eval names it samples_<task>_<ISO date>; the date keeps gsm8k_cot out of gsm8k.
    name = re.compile(rf"samples_{re.escape(task)}_\d{{4}}-\d\d-\d\dT[^/]*\.jsonl")
    files = sorted(p for p in folder.rglob("samples_*.jsonl") if name.fullmatch(p.name))
    if not files:
        raise ABError(f"{folder}: no samples_{task}_<date>.jsonl (run lm_eval with --log_samples)")
    if len(files) > 1:
        raise ABError(
            f"{folder} holds {len(files)} samples_{task}_*.jsonl files "
            f"({', '.join(str(f.relative_to(folder)) for f in files)}), as a second lm_eval run "
            "into the same --output_path leaves them: give the folder of one run, or move "
            "the others away"
        )
    return files[0]


def load_folders(folders: list[Path], task: str, metric: str) -> list[Run]:
    """The runs in `folders`, each a samples file of its own."""
    files = [samples_file(folder, task) for folder in folders]
    seen: dict[Path, Path] = {}
    for folder, file in zip(folders, files):
        if file.resolve() in seen:
            raise ABError(
                f"{seen[file.resolve()]} and {folder} are one run ({file.name}): give the "
                "folders of two lm_eval runs"
            )
        seen[file.resolve()] = folder
    return [load_samples(file, str(folder), metric) for folder, file in zip(folders, files)]


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


def compare(runs: list[Run]) -> list[Comparison]:
    """The first run is the reference."""
    ref = runs[0]
    rows = []
    for run in runs:
        check_same_questions(ref, run)
        for filter_name, answers in sorted(run.correct.items()):
            accuracy = sum(answers.values()) / len(answers)
            if run is ref:
                rows.append(Comparison(run.name, filter_name, accuracy, len(answers)))
                continue
            base = ref.correct.get(filter_name)
            if base is None or base.keys() != answers.keys():
                raise ABError(
                    f"{run.name}: filter {filter_name!r} does not cover the same questions as "
                    f"{ref.name}"
                )
            lost = sum(base[q] and not answers[q] for q in base)
            gained = sum(answers[q] and not base[q] for q in base)
            identical = sum(run.responses[q] == ref.responses[q] for q in base)
            rows.append(
                Comparison(run.name, filter_name, accuracy, len(answers), lost, gained, identical)
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
        "| run | filter | accuracy | lost / gained vs reference | McNemar z "
        "| identical responses vs reference |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.lost is None:
            lines.append(f"| {r.run} (reference) | {r.filter} | {r.accuracy:.3f} | - | - | - |")
        else:
            lines.append(
                f"| {r.run} | {r.filter} | {r.accuracy:.3f} | {r.lost} / {r.gained} "
                f"| {r.mcnemar_z:.1f} | {r.identical} / {r.questions} |"
            )
    return "\n".join(lines)


# endpoints -------------------------------------------------------------------


def read_docs(path: Path) -> list[dict[str, str]]:
    """GSM8K-format lines: {"question": ..., "answer": "... #### N"}."""
    docs = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            question, answer = doc["question"], doc["answer"]
            if not isinstance(question, str) or not isinstance(answer, str):
                raise TypeError("question and answer must be strings")
        except (ValueError, KeyError, TypeError) as e:
            raise ABError(f"{path}:{number}: not a GSM8K question/answer line: {e}") from None
        if "#### " not in answer:
            raise ABError(f"{path}:{number}: the answer has no '#### <number>' final answer")
        if not NUMBER.fullmatch(_normalise(answer)):
            raise ABError(
                f"{path}:{number}: the final answer {answer.rsplit('#### ', 1)[1]!r} is not "
                "a number, which '#### <number>' needs"
            )
        docs.append({"question": question, "answer": answer})
    if not docs:
        raise ABError(f"{path}: no questions")
    return docs


def prompts(docs: list[dict[str, str]], shots: list[dict[str, str]], num_fewshot: int) -> list[str]:
    """lm_eval's gsm8k layout; each question gets its own fixed random few-shot draw."""
    if num_fewshot > len(shots):
        raise ABError(f"{num_fewshot} few-shot examples asked for, {len(shots)} given")
    out = []
    for i, doc in enumerate(docs):
        examples = random.Random(i).sample(shots, num_fewshot)
        context = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in examples)
        out.append(f"{context}Question: {doc['question']}\nAnswer:")
    return out


def _extract(text: str, pattern: re.Pattern, last: bool) -> str:
    """lm_eval's regex filter followed by take_first."""
    found = pattern.findall(text)
    if not found:
        return "[invalid]"
    match = found[-1 if last else 0]
    if isinstance(match, tuple):
        match = next((m for m in match if m), "[invalid]")
    return match.strip()


def _normalise(text: str) -> str:
    """lm_eval's exact_match with gsm8k's regexes_to_ignore and ignore_case."""
    for pattern in IGNORED:
        text = re.sub(pattern, "", text)
    return text.lower()


def score(text: str, answer: str) -> dict[str, bool]:
    target = _normalise(answer)
    return {
        "strict-match": _normalise(_extract(text, STRICT, last=False)) == target,
        "flexible-extract": _normalise(_extract(text, FLEXIBLE, last=True)) == target,
    }


def _call(url: str, timeout: float, payload: dict | None = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with OPENER.open(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        raise ABError(f"{url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
    except (TimeoutError, urllib.error.URLError) as e:
        if isinstance(getattr(e, "reason", e), TimeoutError):
            raise ABError(f"{url}: no answer within {timeout:g} s (--timeout)") from None
        raise ABError(f"cannot reach {url}: {e.reason}") from None
    except http.client.HTTPException as e:
        raise ABError(f"{url}: not an HTTP answer: {e!r}") from None
    except (OSError, ValueError) as e:
        raise ABError(f"cannot reach {url}: {e!r}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise ABError(f"{url}: the answer is not JSON: {body[:300]!r}") from None


def served_model(base_url: str, timeout: float) -> str:
    body = _call(f"{base_url}/models", timeout)
    try:
        model = body["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        model = None
    if not isinstance(model, str):
        raise ABError(f"{base_url}/models: no model listed; give --model")
    return model


def complete(base_url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> str:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stop": [STOP],
    }
    body = _call(f"{base_url}/completions", timeout, payload)
    try:
        text = body["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        text = None
    if not isinstance(text, str):
        raise ABError(f"{base_url}/completions: not a completions answer: {str(body)[:300]}")
    return text


def query(
    base_url: str,
    model: str,
    docs: list[dict[str, str]],
    texts: list[str],
    max_tokens: int,
    concurrency: int,
    timeout: float,
) -> Run:
    """A run from one endpoint: prompt `texts[i]` for `docs[i]`, `concurrency` in flight,
    with a progress bar on stderr."""
    outputs = thread_map(
        lambda text: complete(base_url, model, text, max_tokens, timeout),
        texts,
        max_workers=concurrency,
        desc=base_url,
        unit="question",
        file=sys.stderr,
    )
    correct: dict[str, dict[int, bool]] = {}
    for doc_id, (doc, output) in enumerate(zip(docs, outputs)):
        for filter_name, right in score(output, doc["answer"]).items():
            correct.setdefault(filter_name, {})[doc_id] = right
    return Run(
        base_url,
        correct,
        dict(enumerate(outputs)),
        {i: {"doc": json.dumps(doc, sort_keys=True)} for i, doc in enumerate(docs)},
    )


def endpoint_runs(
    urls: list[str],
    docs: list[dict[str, str]],
    texts: list[str],
    max_tokens: int,
    concurrency: int,
    timeout: float,
    model: str | None = None,
) -> list[Run]:
    """Every endpoint must name its model (or be given one) before any is queried."""
    urls = [url.rstrip("/") for url in urls]
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018  (raises for a port that is not a number)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ABError(f"{url} is not an http(s) URL, e.g. http://127.0.0.1:8000/v1")
    models = [model or served_model(url, timeout) for url in urls]
    if len(set(models)) > 1:
        raise ABError(
            f"the endpoints serve different models ({', '.join(models)}): compare one model "
            "with DBO off and on, or give --model to ask each for the same name"
        )
    return [
        query(url, m, docs, texts, max_tokens, concurrency, timeout) for url, m in zip(urls, models)
    ]
