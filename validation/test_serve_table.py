"""serve_table.sh refuses a mode or lane it does not know before it touches the GPU machine;
what it keeps of an arm (ARM.json) is read from the lines the harness logs and /metrics."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dsa_dbo_harness.serve_report import record

SCRIPT = Path(__file__).parent / "serve_table.sh"


@pytest.mark.parametrize(
    ("mode", "lane", "says"),
    [
        ("xx", "0", "mode: ht or ll, not xx"),
        ("ht", "x", "SERVE_TABLE_LANE: a lane number 0-9, not 'x'"),
        ("ll", "12", "SERVE_TABLE_LANE: a lane number 0-9, not '12'"),
    ],
)
def test_bad_mode_or_lane_exits_2_with_a_message(tmp_path, mode, lane, says):
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), mode, "off_a"],
        env={**os.environ, "SERVE_TABLE_LANE": lane},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stdout.strip()) == (2, says)
    assert list(tmp_path.iterdir()) == []


def test_an_arms_record_names_runner_release_forwards_and_acceptance(tmp_path, monkeypatch):
    line = "(Worker_DP{r}_EP{r} pid=1) INFO 12-05 10:00:00 [__init__.py:1] dsa_dbo_harness: "
    for rank in (0, 1):
        (tmp_path / f"mtp_fix.rank{rank}.log").write_text(
            line.format(r=rank)
            + "worker on Model Runner V2, vLLM 0.34.0\n"
            + line.format(r=rank)
            + "1 microbatched forwards of 3; Model Runner V2, vLLM 0.34.0\n"
            + line.format(r=rank)
            + "90 microbatched forwards of 120; checker 40 reads, 0 bad, 3 steps past the "
            "workspace; "
            "Model Runner V2, vLLM 0.34.0\n"
            + line.format(r=rank).replace("dsa_dbo_harness: ", "")
            + "Model loading took 1.09 GiB memory and 3.1 seconds\n"
            + line.format(r=rank).replace("dsa_dbo_harness: ", "")
            + "vllm-dsa-dbo: DeepseekV32Model keeps shared top-k per DBO microbatch: 2 "
            "microbatches, 2 index groups with followers, 8,655,368 bytes (8.3 MiB) allocated\n"
        )
    (tmp_path / "mtp_fix.metrics.txt").write_text(
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.\n"
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 300.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 100.0\n'
        'vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 10.0\n'
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 300.0\n'
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("VLLM_DSA_DBO_HARNESS_GATES", "0")
    got = record(tmp_path, "mtp_fix", "ht")
    assert got["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert got["env"]["VLLM_DSA_DBO_HARNESS_GATES"] == "0"
    assert got["vllm_version"] == ["0.34.0"] and got["runner"] == ["Model Runner V2"]
    worker = {
        "microbatched_forwards": 90,
        "forwards": 120,
        "checked_reads": 40,
        "bad_reads": 0,
        "past_workspace_steps": 3,
    }
    assert got["workers"] == [worker, worker]
    assert got["spec_decode"] == {
        "drafts": 300.0,
        "draft_tokens": 400.0,
        "accepted_tokens": 10.0,
        "acceptance": 10 / 400,
    }
    assert got["memory"] == [{"model_loading_gib": 1.09, "plugin_bytes": 8_655_368}] * 2
    off = record(tmp_path, "off_a", "ht")
    assert off["spec_decode"] is None
    assert off["memory"] == [{"model_loading_gib": None, "plugin_bytes": None}] * 2
