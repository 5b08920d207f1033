"""`vllm-dsa-dbo ab`: lm_eval sample folders compared question by question."""

from __future__ import annotations

import hashlib
import json
import math
import re
import socket
import socketserver
import threading
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from test_cli import cli
from vllm_dsa_dbo.ab import prompts, score

SAMPLES = "samples_gsm8k_2026-11-30T00-00-00.123456.jsonl"


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
            lines.append(
                json.dumps(
                    {
                        "doc_id": doc_id,
                        "doc": doc,
                        "filter": filter_name,
                        "exact_match": float(right),
                        "target": "4",
                        "resps": [[texts[doc_id] if texts else "x"]],
                        "filtered_resps": ["[invalid]"],
                        "doc_hash": hashlib.sha256(json.dumps(doc).encode()).hexdigest(),
                    }
                )
            )
    (folder / name).write_text("\n".join(lines) + "\n")


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
    assert (
        "| 0 / 0 | 0.0 | 2 / 3 |" in cli("ab", str(tmp_path / "off"), str(tmp_path / "on")).stdout
    )


def test_score_is_lm_eval_gsm8k():
    answer = "Half of 2,468 is <<2468/2=1234>>1234.\n#### 1234"
    assert score("so $1,234.\n#### 1,234", answer) == {
        "strict-match": True,
        "flexible-extract": True,
    }
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
    lines = [
        json.dumps({"question": f"What is {n} plus 0?", "answer": f"{n} + 0 = {n}\n#### {n}"})
        for n in range(count)
    ]
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
        result = cli(
            "ab",
            "--endpoints",
            off,
            on + "/",
            "--questions",
            str(tmp_path / "test.jsonl"),
            "--fewshot",
            str(tmp_path / "train.jsonl"),
            "--num-fewshot",
            "2",
            "--max-tokens",
            "32",
            "--concurrency",
            "4",
            "--json",
        )
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
        assert (request["temperature"], request["max_tokens"], request["stop"]) == (
            0,
            32,
            ["Question:"],
        )
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
            (
                "--endpoints",
                up,
                up,
                "--questions",
                str(tmp_path / "bad.jsonl"),
            ): "not a GSM8K question",
            ("--endpoints", up, up, "--questions", str(tmp_path / "none.jsonl")): "cannot read",
            ("--endpoints", up, *questions): "two or more URLs",
            ("--endpoints", up, up): "two or more URLs and --questions",
            (
                "--endpoints",
                up,
                up,
                *questions,
                "--num-fewshot",
                "1",
            ): "--num-fewshot needs --fewshot",
            (
                "--endpoints",
                up,
                up,
                *questions,
                "--fewshot",
                str(tmp_path / "test.jsonl"),
                "--num-fewshot",
                "3",
            ): "3 few-shot examples asked for, 2 given",
            (str(tmp_path), "--endpoints", up, up, *questions): "not both",
            (str(tmp_path), str(tmp_path), *questions): "--questions apply only with --endpoints",
            (
                "--endpoints",
                up,
                up,
                *questions,
                "--fewshot",
                str(tmp_path / "test.jsonl"),
            ): "--fewshot needs --num-fewshot N",
        }
        for args, message in cases.items():
            result = cli("ab", *args)
            assert result.returncode == 2, args
            assert message in result.stderr, (args, result.stderr)


@contextmanager
def raw_server(reply: bytes):
    """A TCP server on localhost that answers every connection with `reply`, HTTP or not."""

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            self.rfile.readline()
            self.wfile.write(reply)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def http_reply(body: bytes, status: str = "200 OK") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: "
        f"{len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def test_bad_questions_urls_and_server_replies(tmp_path):
    """Every malformed question file, URL and reply is one `error:` line, exit 2."""
    write_questions(tmp_path / "test.jsonl", 2)
    files = {
        "latin1.jsonl": '{"question": "é", "answer": "#### 1"}\n'.encode("latin-1"),
        "no_final.jsonl": b'{"question": "Why?", "answer": "because"}\n',
        "numbers.jsonl": b'{"question": 7, "answer": "#### 7"}\n',
        "empty.jsonl": b"\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    questions = ["--questions", str(tmp_path / "test.jsonl")]
    no_text = http_reply(b'{"choices": [{"text": null}], "data": [{"id": "tiny-glm5"}]}')
    with (
        fake_openai(lambda prompt: "#### 0") as (up, _),
        raw_server(b"garbage\r\n\r\n") as not_http,
        raw_server(http_reply(b"<html>busy</html>")) as html,
        raw_server(no_text) as null_text,
        raw_server(http_reply(b'{"data": []}')) as no_models,
        raw_server(http_reply(b'{"data": [{"id": "other"}]}')) as other_model,
        raw_server(http_reply(b"overloaded", "503 Service Unavailable")) as busy,
    ):
        cases = {
            ("--questions", str(tmp_path / "latin1.jsonl")): "is not UTF-8 text",
            ("--questions", str(tmp_path / "no_final.jsonl")): "has no '#### <number>' final",
            ("--questions", str(tmp_path / "numbers.jsonl")): "question and answer must be strings",
            ("--questions", str(tmp_path / "empty.jsonl")): "no questions",
            ("--questions", str(tmp_path)): "cannot read",
        }
        for args in list(cases):
            cases[("--endpoints", up, up, *args)] = cases.pop(args)
        for urls, message in {
            (up, "localhost:8000/v1"): "localhost:8000/v1 is not an http(s) URL",
            (up, "ftp://127.0.0.1/v1"): "is not an http(s) URL",
            (up, "http://127.0.0.1:port/v1"): "is not an http(s) URL",
            (up, "http://[::1/v1"): "is not an http(s) URL",
            (up, not_http): "/v1/models: not an HTTP answer: BadStatusLine",
            (up, html): "the answer is not JSON: b'<html>busy</html>'",
            (null_text, up): "/completions: not a completions answer",
            (up, no_models): "/models: no model listed; give --model",
            (up, other_model): "the endpoints serve different models (tiny-glm5, other)",
            (up, busy): "HTTP 503: overloaded",
        }.items():
            cases[("--endpoints", *urls, *questions)] = message
        cases[
            (
                "--endpoints",
                up,
                up,
                "--questions",
                str(tmp_path / "test.jsonl"),
                "--model",
                "m",
                "--num-fewshot",
                "-1",
            )
        ] = "--num-fewshot: must be at least 0"
        for args, message in cases.items():
            result = cli("ab", *args)
            assert result.returncode == 2, (args, result.stdout, result.stderr)
            assert message in result.stderr, (args, result.stderr)
            assert "Traceback" not in result.stderr


def test_answers_that_are_no_number_are_refused(tmp_path):
    (tmp_path / "abc.jsonl").write_text('{"question": "Why?", "answer": "because\\n#### abc"}\n')
    (tmp_path / "blank.jsonl").write_text('{"question": "Why?", "answer": "because\\n#### "}\n')
    with fake_openai(lambda prompt: "#### 0") as (up, received):
        for name, shown in (("abc", "'abc'"), ("blank", "''")):
            result = cli(
                "ab", "--endpoints", up, up, "--questions", str(tmp_path / f"{name}.jsonl")
            )
            assert result.returncode == 2 and result.stdout == "", result.stderr
            assert f"{name}.jsonl:1: the final answer {shown} is not a number" in result.stderr
    assert received == []


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
    for other in ("off", "link", "off/model"):
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


def test_endpoints_show_progress_and_time_out(tmp_path):
    write_questions(tmp_path / "test.jsonl", 6)
    questions = ["--questions", str(tmp_path / "test.jsonl")]
    with fake_openai(lambda prompt: "#### 0") as (up, _):
        result = cli("ab", "--endpoints", up, up, *questions)
        assert result.returncode == 0, result.stderr
        assert f"{up}: 100%" in result.stderr and "| 6/6 [" in result.stderr, result.stderr
        with socket.socket() as listening:  # connections wait in its backlog, unanswered
            listening.bind(("127.0.0.1", 0))
            listening.listen()
            silent = f"http://127.0.0.1:{listening.getsockname()[1]}/v1"
            result = cli("ab", "--endpoints", up, silent, *questions, "--timeout", "1")
    assert result.returncode == 2, result.stderr
    assert f"{silent}/models: no answer within 1 s (--timeout)" in result.stderr
