"""`vllm-dsa-dbo ab`: lm_eval sample folders compared question by question."""

from __future__ import annotations

import json
import math
import re
import socket
import threading
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from test_cli import cli

from vllm_dsa_dbo.ab import prompts, score


def write_run(folder, answers: dict[str, list[int]], texts: list[str] | None = None) -> None:
    """lm_eval 0.4.13 --log_samples layout: one line per question and filter."""
    folder.mkdir(parents=True)
    lines = [
        json.dumps({"doc_id": doc_id, "filter": name, "exact_match": float(right),
                    "target": "4", "resps": [[texts[doc_id] if texts else "x"]],
                    "filtered_resps": ["[invalid]"]})
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


def test_identical_responses_column(tmp_path):
    write_run(tmp_path / "off", {"strict-match": [0, 0, 0]})
    write_run(tmp_path / "on", {"strict-match": [0, 0, 0]}, texts=["x", "y", "x"])
    rows = json.loads(cli("ab", str(tmp_path / "off"), str(tmp_path / "on"), "--json").stdout)
    assert [r["identical"] for r in rows] == [None, 2]
    assert "| 0 / 0 | 0.0 | 2 / 3 |" in cli("ab", str(tmp_path / "off"), str(tmp_path / "on")).stdout


def test_score_is_lm_eval_gsm8k():
    answer = "Half of 2,468 is <<2468/2=1234>>1234.\n#### 1234"
    assert score("so $1,234.\n#### 1,234", answer) == {"strict-match": True, "flexible-extract": True}
    assert score("It is 1234 or 7", answer) == {"strict-match": False, "flexible-extract": False}
    assert score("7 then 1234.", answer) == {"strict-match": False, "flexible-extract": True}
    assert score("#### 1234 and 7", answer) == {"strict-match": True, "flexible-extract": False}


def test_prompt_is_the_task_layout():
    shots = [{"question": f"q{i}", "answer": f"a{i}\n#### {i}"} for i in range(3)]
    [plain] = prompts([{"question": "Why?", "answer": "#### 1"}], shots, 0)
    assert plain == "Question: Why?\nAnswer:"
    [two] = prompts([{"question": "Why?", "answer": "#### 1"}], shots, 2)
    assert two.count("Question: q") == 2 and two.endswith("\n\nQuestion: Why?\nAnswer:")
    assert "Answer: a" in two and "\n#### " in two


@contextmanager
def fake_openai(answer: Callable[[str], str]):
    """An OpenAI-compatible /v1 on localhost: `answer(prompt)` is every completion."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.reply({"object": "list", "data": [{"id": "tiny-glm5", "object": "model"}]})

        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append({"path": self.path, **payload})
            self.reply({"choices": [{"index": 0, "text": answer(payload["prompt"])}]})

        def reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1", received
    finally:
        server.shutdown()
        server.server_close()


def write_questions(path, count: int) -> None:
    lines = [json.dumps({"question": f"What is {n} plus 0?", "answer": f"{n} + 0 = {n}\n#### {n}"})
             for n in range(count)]
    path.write_text("\n".join(lines) + "\n")


def asked(prompt: str) -> int:
    return int(re.findall(r"What is (\d+) plus 0\?\nAnswer:$", prompt)[0])


def test_endpoints(tmp_path):
    write_questions(tmp_path / "test.jsonl", 6)
    write_questions(tmp_path / "train.jsonl", 3)

    def right(prompt):
        return f" {asked(prompt)} + 0 = {asked(prompt)}.\n#### {asked(prompt)}"

    def dbo(prompt):  # wrong on questions 0 and 1, right in other words on 2
        n = asked(prompt)
        return " #### 999" if n < 2 else f" It is {n}.\n#### {n}" if n == 2 else right(prompt)

    with fake_openai(right) as (off, off_got), fake_openai(dbo) as (on, _):
        result = cli("ab", "--endpoints", off, on + "/", "--questions", str(tmp_path / "test.jsonl"),
                     "--fewshot", str(tmp_path / "train.jsonl"), "--num-fewshot", "2",
                     "--max-tokens", "32", "--concurrency", "4", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["run"], r["filter"]): r for r in json.loads(result.stdout)}
    assert rows[off, "strict-match"]["accuracy"] == 1.0
    for name in ("strict-match", "flexible-extract"):
        row = rows[on, name]
        assert (row["lost"], row["gained"], row["identical"], row["questions"]) == (2, 0, 3, 6)
        assert math.isclose(row["mcnemar_z"], 2 / math.sqrt(2))
    assert len(off_got) == 6
    for request in off_got:
        assert request["path"] == "/v1/completions" and request["model"] == "tiny-glm5"
        assert (request["temperature"], request["max_tokens"], request["stop"]) == (0, 32, ["Question:"])
        assert request["prompt"].count("Question: ") == 3


def test_help_names_both_modes():
    result = cli("ab", "--help")
    assert result.returncode == 0
    assert "RUN" in result.stdout and "--endpoints URL" in result.stdout


def test_endpoint_errors(tmp_path):
    write_questions(tmp_path / "test.jsonl", 2)
    (tmp_path / "bad.jsonl").write_text('{"question": "no answer"}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with fake_openai(lambda prompt: "#### 0") as (up, _):
        questions = ["--questions", str(tmp_path / "test.jsonl")]
        cases = {
            ("--endpoints", up, closed, *questions): "cannot reach",
            ("--endpoints", up, up, "--questions", str(tmp_path / "bad.jsonl")): "not a GSM8K question",
            ("--endpoints", up, up, "--questions", str(tmp_path / "none.jsonl")): "cannot read",
            ("--endpoints", up, *questions): "two or more URLs",
            ("--endpoints", up, up): "two or more URLs and --questions",
            ("--endpoints", up, up, *questions, "--num-fewshot", "1"): "--num-fewshot needs --fewshot",
            ("--endpoints", up, up, *questions, "--fewshot", str(tmp_path / "test.jsonl"),
             "--num-fewshot", "3"): "3 few-shot examples asked for, 2 given",
            (str(tmp_path), "--endpoints", up, up, *questions): "not both",
        }
        for args, message in cases.items():
            result = cli("ab", *args)
            assert result.returncode == 2, args
            assert message in result.stderr, (args, result.stderr)
