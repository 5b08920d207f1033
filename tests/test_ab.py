"""`vllm-dsa-dbo ab`: lm_eval sample folders compared question by question."""

from __future__ import annotations

import json
import math

from test_cli import cli


def write_run(folder, answers: dict[str, list[int]]) -> None:
    """lm_eval --log_samples layout: one line per question and filter."""
    folder.mkdir(parents=True)
    lines = [
        json.dumps({"doc_id": doc_id, "filter": name, "exact_match": float(right),
                    "target": "4", "resps": [["x"]], "filtered_resps": ["x"]})
        for name, rights in answers.items()
        for doc_id, right in enumerate(rights)
    ]
    (folder / "samples_gsm8k_2026-11-30T00-00-00.jsonl").write_text("\n".join(lines) + "\n")


def test_lost_gained_and_mcnemar(tmp_path):
    ref = [1] * 30 + [0] * 10
    run = [0] * 12 + [1] * 18 + [1] * 3 + [0] * 7  # lost 12, gained 3
    write_run(tmp_path / "off", {"strict-match": ref, "flexible-extract": ref})
    write_run(tmp_path / "on", {"strict-match": run, "flexible-extract": ref})
    result = cli("ab", str(tmp_path / "off"), str(tmp_path / "on"), "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["run"].rsplit("/", 1)[1], r["filter"]): r for r in json.loads(result.stdout)}
    strict = rows["on", "strict-match"]
    assert (strict["lost"], strict["gained"]) == (12, 3)
    assert strict["accuracy"] == 21 / 40
    assert math.isclose(strict["mcnemar_z"], 9 / math.sqrt(15))
    assert rows["on", "flexible-extract"]["mcnemar_z"] == 0.0
    assert rows["off", "strict-match"]["lost"] is None
    text = cli("ab", str(tmp_path / "off"), str(tmp_path / "on")).stdout
    assert "| 12 / 3 | 2.3 |" in text


def test_bad_folders(tmp_path):
    write_run(tmp_path / "off", {"strict-match": [1, 0, 1]})
    write_run(tmp_path / "short", {"strict-match": [1, 0]})
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "samples_gsm8k_x.jsonl").write_text('{"doc_id": 0}\n')
    cases = {
        "missing": "is not a folder",
        "empty": "no samples_gsm8k_*.jsonl",
        "broken": "not an lm_eval sample with 'exact_match'",
        "short": "does not cover the same questions",
    }
    for folder, message in cases.items():
        result = cli("ab", str(tmp_path / "off"), str(tmp_path / folder))
        assert result.returncode == 2, folder
        assert message in result.stderr, (folder, result.stderr)
