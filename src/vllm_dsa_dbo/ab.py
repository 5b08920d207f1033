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

import json
import math
import random
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED = [",", r"\$", r"(?s).*#### ", r"\.$"]
STOP = "Question:"
TIMEOUT_S = 300
# lm_eval's aiohttp client ignores proxy variables too; endpoints are reached directly.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ABError(Exception):
    """Input that cannot be compared: a folder, file or endpoint."""


@dataclass(frozen=True)
class Run:
    """Per filter, whether each question (doc id) was answered right; each question's output."""

    name: str
    correct: dict[str, dict[int, bool]]
    responses: dict[int, object]


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


def load_samples(folder: Path, task: str, metric: str) -> Run:
    """A run from lm_eval's samples_<task>_*.jsonl (`resps` is the generated text)."""
    files = sorted(folder.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise ABError(f"{folder}: no samples_{task}_*.jsonl (run lm_eval with --log_samples)")
    correct: dict[str, dict[int, bool]] = {}
    responses: dict[int, object] = {}
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
                doc_id = int(sample["doc_id"])
                correct.setdefault(sample.get("filter", "none"), {})[doc_id] = float(sample[metric]) >= 1.0
                responses[doc_id] = sample["resps"]
            except (ValueError, KeyError, TypeError) as e:
                raise ABError(f"{path}:{number}: not an lm_eval sample with {metric!r}: {e}") from None
    return Run(str(folder), correct, responses)


def compare(runs: list[Run]) -> list[Comparison]:
    """The first run is the reference."""
    ref = runs[0]
    rows = []
    for run in runs:
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
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ABError(f"cannot read {path}: {e.strerror or e}") from None
    docs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            docs.append({"question": str(doc["question"]), "answer": str(doc["answer"])})
        except (ValueError, KeyError, TypeError) as e:
            raise ABError(f"{path}:{number}: not a GSM8K question/answer line: {e}") from None
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


def _call(url: str, payload: dict | None = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with OPENER.open(request, timeout=TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        raise ABError(f"{url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
    except urllib.error.URLError as e:
        raise ABError(f"cannot reach {url}: {e.reason}") from None
    except OSError as e:
        raise ABError(f"cannot reach {url}: {e}") from None
    except ValueError:
        raise ABError(f"{url}: the answer is not JSON") from None


def served_model(base_url: str) -> str:
    body = _call(f"{base_url}/models")
    try:
        return body["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise ABError(f"{base_url}/models: no model listed") from None


def complete(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "stop": [STOP]}
    body = _call(f"{base_url}/completions", payload)
    try:
        return body["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        raise ABError(f"{base_url}/completions: not a completions answer: {str(body)[:300]}") from None


def query(
    base_url: str, model: str, docs: list[dict[str, str]], texts: list[str], max_tokens: int,
    concurrency: int,
) -> Run:
    """A run from one endpoint: prompt `texts[i]` for `docs[i]`, `concurrency` in flight."""
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(lambda text: complete(base_url, model, text, max_tokens), texts))
    correct: dict[str, dict[int, bool]] = {}
    for doc_id, (doc, output) in enumerate(zip(docs, outputs)):
        for filter_name, right in score(output, doc["answer"]).items():
            correct.setdefault(filter_name, {})[doc_id] = right
    return Run(base_url, correct, dict(enumerate(outputs)))


def endpoint_runs(
    urls: list[str], docs: list[dict[str, str]], texts: list[str], max_tokens: int,
    concurrency: int, model: str | None = None,
) -> list[Run]:
    """Every endpoint must name its model (or be given one) before any is queried."""
    urls = [url.rstrip("/") for url in urls]
    models = [model or served_model(url) for url in urls]
    return [query(url, m, docs, texts, max_tokens, concurrency) for url, m in zip(urls, models)]
