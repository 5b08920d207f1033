"""`vllm-dsa-dbo ab`: lm_eval sample files compared question by question."""

from __future__ import annotations

import hashlib
import io
import json
import math
import statistics
from contextlib import redirect_stderr, redirect_stdout
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

from vllm_dsa_dbo.ab import mcnemar_p
from vllm_dsa_dbo.cli import main

SAMPLES = "samples_gsm8k_2026-11-30T00-00-00.123456.jsonl"
# lm_eval 0.4.13's own samples and results of validation/serve_ab.sh (2 GPUs, random weights).
SERVED = Path(__file__).resolve().parents[1] / "validation/results/2026-11-30-two-gpu-serve"


def cli(*args: str) -> SimpleNamespace:
    """`vllm-dsa-dbo ARGS` in this process: it needs no fresh interpreter."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_run(
    folder,
    answers: dict[str, list[int]],
    texts: list[str] | None = None,
    questions: list[str] | None = None,
    name: str = SAMPLES,
) -> None:
    """lm_eval 0.4.13 --log_samples layout: one line per question and filter."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for filter_name, rights in answers.items():
        for doc_id, right in enumerate(rights):
            doc = {"question": questions[doc_id] if questions else f"q{doc_id}", "answer": "#### 4"}
            prompt = f"Question: {doc['question']}\nAnswer:"
            until = {"until": ["Question:"], "do_sample": False, "max_gen_toks": 32}
            sample = {
                "doc_id": doc_id,
                "doc": doc,
                "target": doc["answer"],
                "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": until}},
                "resps": [[texts[doc_id] if texts else "x"]],
                "filtered_resps": ["4" if right else "[invalid]"],
                "filter": filter_name,
                "metrics": ["exact_match"],
                "doc_hash": sha256(json.dumps(doc, indent=2, ensure_ascii=False)),
                "prompt_hash": sha256(prompt),
                "target_hash": sha256(doc["answer"]),
                "exact_match": float(right),
            }
            lines.append(json.dumps(sample))
    (folder / name).write_text("\n".join(lines) + "\n")


def test_lost_gained_and_mcnemar(tmp_path):
    ref = [1] * 30 + [0] * 10
    run = [0] * 12 + [1] * 18 + [1] * 3 + [0] * 7  # lost 12, both right 18, gained 3
    write_run(tmp_path / "off", {"strict-match": ref, "flexible-extract": ref})
    write_run(tmp_path / "on", {"strict-match": run, "flexible-extract": ref})
    result = cli("ab", str(tmp_path / "off"), str(tmp_path / "on"), "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["run"].rsplit("/", 1)[1], r["filter"]): r for r in json.loads(result.stdout)}
    strict = rows["on", "strict-match"]
    assert (strict["lost"], strict["gained"]) == (12, 3)
    assert (strict["both_right"], strict["both_wrong"]) == (18, 7)
    assert strict["accuracy"] == 21 / 40
    assert math.isclose(strict["stderr"], statistics.stdev(run) / math.sqrt(40))
    assert math.isclose(strict["mcnemar_z"], 9 / math.sqrt(15))
    assert strict["mcnemar_p"] == 2 * (1 + 15 + 105 + 455) / 2**15
    assert rows["on", "flexible-extract"]["mcnemar_z"] == 0.0
    assert rows["on", "flexible-extract"]["mcnemar_p"] == 1.0
    assert rows["off", "strict-match"]["lost"] is None
    assert rows["off", "strict-match"]["mcnemar_p"] is None
    text = cli("ab", str(tmp_path / "off"), str(tmp_path / "on")).stdout
    assert "| 0.525 ± 0.080 | 18 / 7 | 12 / 3 | 2.3 | 0.0352 | 40 / 40 |" in text


def test_alpha_fails_a_run_that_lost_significantly(tmp_path):
    ref = [1] * 30 + [0] * 10
    write_run(tmp_path / "off", {"strict-match": ref})
    write_run(tmp_path / "same", {"strict-match": ref})
    write_run(tmp_path / "better", {"strict-match": [1] * 40})  # gained 10
    write_run(tmp_path / "worse", {"strict-match": [0] * 12 + [1] * 21 + [0] * 7})  # lost 12, 3
    off, same, better, worse = (str(tmp_path / n) for n in ("off", "same", "better", "worse"))
    assert cli("ab", off, worse).returncode == 0
    assert cli("ab", off, same, better, "--alpha", "0.05").returncode == 0
    result = cli("ab", off, same, worse, "--alpha", "0.05")
    assert result.returncode == 1
    assert "| 12 / 3 | 2.3 | 0.0352 |" in result.stdout
    assert result.stderr == (
        f"worse than {off} at p < 0.05: {worse} (strict-match): lost 12, gained 3, exact p 0.0352\n"
    )
    assert cli("ab", off, worse, "--alpha", "0.01").returncode == 0
    for bad in ("0", "1.5", "x"):
        result = cli("ab", off, worse, "--alpha", bad)
        assert result.returncode == 2 and "--alpha" in result.stderr, bad
    # A loss this large has an exact p below the smallest float: 0.0, still below alpha.
    write_run(tmp_path / "big_off", {"strict-match": [1] * 1100})
    write_run(tmp_path / "big_on", {"strict-match": [0] * 1100})
    result = cli("ab", str(tmp_path / "big_off"), str(tmp_path / "big_on"), "--alpha", "0.05")
    assert result.returncode == 1 and "lost 1100, gained 0, exact p 0\n" in result.stderr


def test_mcnemar_p_is_the_exact_two_sided_binomial_test():
    """Against the definition (scipy's binomtest): the chance, at 1/2, of every split of the
    discordant pairs no likelier than the one seen."""

    def by_definition(lost: int, gained: int) -> float:
        n = lost + gained
        chance = [Fraction(math.comb(n, k), 2**n) for k in range(n + 1)]
        return float(sum(c for c in chance if c <= chance[lost]))

    for lost in range(12):
        for gained in range(12):
            expected = by_definition(lost, gained)
            assert math.isclose(mcnemar_p(lost, gained), expected), (lost, gained)
    assert mcnemar_p(2, 0) == 0.5 and mcnemar_p(0, 0) == 1.0
    assert 0.0 < mcnemar_p(600, 700) < 0.01 and mcnemar_p(650, 650) == 1.0


def test_lm_eval_runs_of_the_served_model():
    """lm_eval's own samples: its accuracy and standard error per filter (results_*.json),
    and the identical responses of that run's ab.md."""
    runs = [str(SERVED / name) for name in ("off_a", "off_b", "on_stock", "on_fix")]
    result = cli("ab", *runs, "--task", "gsm8k_local", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    for row in rows:
        [results] = Path(row["run"]).glob("results_*.json")
        scored = json.loads(results.read_text())["results"]["gsm8k_local"]
        assert row["accuracy"] == scored[f"exact_match,{row['filter']}"]
        assert row["stderr"] == scored[f"exact_match_stderr,{row['filter']}"]
        assert row["questions"] == scored["sample_len"] == 48
    assert [(r["identical"], r["both_wrong"]) for r in rows] == [(None, None)] * 2 + [
        (27, 48),
        (27, 48),
        (5, 48),
        (5, 48),
        (28, 48),
        (28, 48),
    ]


def test_samples_files_are_runs_too(tmp_path):
    write_run(tmp_path / "off", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "on" / "model", {"strict-match": [1, 1, 1]})
    off, on = tmp_path / "off" / SAMPLES, tmp_path / "on" / "model" / SAMPLES
    rows = json.loads(cli("ab", str(off), str(tmp_path / "on"), "--json").stdout)
    assert [(r["run"], r["gained"]) for r in rows] == [(str(off), None), (str(tmp_path / "on"), 1)]
    (tmp_path / "results.json").write_text("{}\n")
    for args, message in {
        (str(off), str(tmp_path / "results.json")): "is not an lm_eval samples_<task>_<date>",
        (str(off), str(tmp_path / "off")): f"{off} and {tmp_path / 'off'} are one run",
        (str(on),): "give two or more lm_eval runs",
        (): "give two or more lm_eval runs",
    }.items():
        result = cli("ab", *args)
        assert result.returncode == 2 and result.stdout == "", (args, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_bad_folders(tmp_path):
    write_run(tmp_path / "off", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "short", {"strict-match": [1, 0]})
    (tmp_path / "empty").mkdir()
    bad_lines = {
        "broken": '{"doc_id": 0}',
        "float_id": '{"doc_id": 1.5, "exact_match": 1, "resps": []}',
        "list_line": "[1, 2]",
        "bad_metric": '{"doc_id": 0, "exact_match": "yes", "resps": []}',
        "twice": '{"doc_id": 0, "exact_match": 1, "resps": []}\n'
        '{"doc_id": 0, "exact_match": 0, "resps": []}',
        "blank": "\n\n",
    }
    for folder, text in bad_lines.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / SAMPLES).write_text(text + "\n")
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / SAMPLES).write_bytes('{"doc_id": 0, "q": "é"}\n'.encode("latin-1"))
    (tmp_path / "unreadable" / SAMPLES).mkdir(parents=True)  # a folder named like the file
    write_run(tmp_path / "strict_only", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "two_filters", {"strict-match": [1, 0, 1], "flexible-extract": [1, 0, 1]})
    cases = {
        "missing": "is not a folder",
        "empty": "no samples_gsm8k_<date>.jsonl",
        "broken": "not an lm_eval sample with 'exact_match'",
        "float_id": "doc_id 1.5 is not a whole number",
        "list_line": "not an lm_eval sample with 'exact_match'",
        "bad_metric": "not an lm_eval sample with 'exact_match'",
        "twice": "doc_id 0 appears twice",
        "blank": "no samples",
        "latin1": "is not UTF-8 text",
        "unreadable": "cannot read",
        "short": "does not cover the same questions",
        "two_filters": "filters ['flexible-extract', 'strict-match'] are not",
    }
    for folder, message in cases.items():
        result = cli("ab", str(tmp_path / "off"), str(tmp_path / folder))
        assert result.returncode == 2, folder
        assert message in result.stderr, (folder, result.stderr)
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, folder


def test_runs_on_other_questions_are_refused(tmp_path):
    """Same doc ids, other questions (another task version or order): not comparable."""
    write_run(tmp_path / "off", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "on", {"strict-match": [1, 0, 1]}, questions=["q0", "q2", "q1"])
    result = cli("ab", str(tmp_path / "off"), str(tmp_path / "on"))
    assert result.returncode == 2 and result.stdout == ""
    assert "2 doc ids (first 1) hold other questions than in" in result.stderr
    assert "(their doc / doc_hash differ)" in result.stderr


def test_a_folder_with_two_runs_is_refused(tmp_path):
    """A re-run into the same --output_path leaves two samples files: never merged."""
    write_run(tmp_path / "off", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "on" / "model", {"strict-match": [1, 1, 1]})
    write_run(
        tmp_path / "on" / "model",
        {"strict-match": [0, 0, 0]},
        name="samples_gsm8k_2026-12-01T09-30-00.000001.jsonl",
    )
    result = cli("ab", str(tmp_path / "off"), str(tmp_path / "on"))
    assert result.returncode == 2 and result.stdout == ""
    assert "holds 2 samples_gsm8k_*.jsonl files (model/samples_gsm8k_2026-11-30" in result.stderr


def test_another_tasks_samples_are_not_read(tmp_path):
    """gsm8k_cot's samples_gsm8k_cot_<date>.jsonl is not gsm8k's."""
    write_run(tmp_path / "off", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "on", {"strict-match": [1, 0, 1]})
    write_run(
        tmp_path / "on",
        {"strict-match": [0, 0]},
        name="samples_gsm8k_cot_2026-11-30T00-00-00.123456.jsonl",
    )
    rows = json.loads(cli("ab", str(tmp_path / "off"), str(tmp_path / "on"), "--json").stdout)
    assert [(r["questions"], r["lost"]) for r in rows] == [(3, None), (3, 0)]


def test_identical_responses_column(tmp_path):
    write_run(tmp_path / "off", {"strict-match": [0, 0, 0]})
    write_run(tmp_path / "on", {"strict-match": [0, 0, 0]}, texts=["x", "y", "x"])
    rows = json.loads(cli("ab", str(tmp_path / "off"), str(tmp_path / "on"), "--json").stdout)
    assert [r["identical"] for r in rows] == [None, 2]
    text = cli("ab", str(tmp_path / "off"), str(tmp_path / "on")).stdout
    assert "| 0 / 0 | 0.0 | 1 | 2 / 3 |" in text


def test_help_gives_the_lm_eval_command():
    result = cli("ab", "--help")
    assert result.returncode == 0 and "RUN" in result.stdout
    assert "lm_eval --model local-completions" in result.stdout
    assert "--log_samples" in result.stdout
    assert "base_url=http://HOST:8000/v1/completions" in result.stdout


def test_questions_compared_by_the_fields_both_runs_carry(tmp_path):
    """doc_hash in one run, doc only in the other: the same questions, compared."""
    write_run(tmp_path / "hash", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "doc", {"strict-match": [1, 1, 1]})
    for folder, drop in (("hash", "doc"), ("doc", "doc_hash")):
        path = tmp_path / folder / SAMPLES
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text(
            "".join(json.dumps({k: v for k, v in s.items() if k != drop}) + "\n" for s in samples)
        )
    result = cli("ab", str(tmp_path / "hash"), str(tmp_path / "doc"), "--json")
    assert result.returncode == 0, result.stderr
    assert [(r["lost"], r["gained"]) for r in json.loads(result.stdout)] == [(None, None), (0, 1)]
    assert "note: 3 doc ids of" in result.stderr and "not checked to be the same" in result.stderr


def test_one_run_twice_is_refused(tmp_path):
    write_run(tmp_path / "off" / "model", {"strict-match": [1, 0, 1]})
    (tmp_path / "link").symlink_to(tmp_path / "off")
    for other in ("off", "link", "off/model", f"off/model/{SAMPLES}"):
        result = cli("ab", str(tmp_path / "off"), str(tmp_path / other))
        assert result.returncode == 2 and result.stdout == "", (other, result.stderr)
        assert f"{tmp_path / 'off'} and {tmp_path / other} are one run" in result.stderr


def test_metrics_and_filters_that_are_no_number_or_name_are_refused(tmp_path):
    write_run(tmp_path / "off", {"strict-match": [1, 0, 1]})
    for name, sample in {
        "nan": '"exact_match": NaN',
        "infinite": '"exact_match": Infinity',
        "true": '"exact_match": true',
        "text": '"exact_match": "1"',
        "null_filter": '"exact_match": 1, "filter": null',
        "number_filter": '"exact_match": 1, "filter": 3',
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / SAMPLES).write_text(f'{{"doc_id": 0, {sample}, "resps": []}}\n')
        result = cli("ab", str(tmp_path / "off"), str(tmp_path / name))
        assert result.returncode == 2 and "Traceback" not in result.stderr, (name, result.stderr)
        assert f"{SAMPLES}:1: not an lm_eval sample with 'exact_match'" in result.stderr, name
        assert ("not a name" if "filter" in name else "not a number") in result.stderr, name
