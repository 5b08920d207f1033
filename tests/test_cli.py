"""`vllm-dsa-dbo` status / memory / demo, including bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch.nn as nn

from vllm_dsa_dbo.demo import SharedTopkStack, attention_module
from vllm_dsa_dbo.layout import leader_mask
from vllm_dsa_dbo.ubatch_topk import ubatch_topk_bytes


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return subprocess.run(
        [sys.executable, "-m", "vllm_dsa_dbo.cli", *args],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_help_everywhere():
    for args in ([], ["status"], ["memory"], ["demo"]):
        result = cli(*args, "--help")
        assert result.returncode == 0 and "usage: vllm-dsa-dbo" in result.stdout


def test_status_active():
    result = cli("status")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fix active" in result.stdout
    assert "vllm.v1.attention.backends.mla.index_group" in result.stdout


@pytest.mark.parametrize(
    "env, reason",
    [({"VLLM_PLUGINS": "other"}, "VLLM_PLUGINS filters out dsa_dbo"),
     ({"VLLM_DSA_DBO_DISABLE": "1"}, "VLLM_DSA_DBO_DISABLE is set")],
)
def test_status_inactive(env, reason):
    result = cli("status", **env)
    assert result.returncode == 1
    assert "fix NOT active" in result.stdout and reason in result.stdout


def test_memory_glm53_is_19_groups_216_mib():
    result = cli("memory", "--preset", "glm-5.3", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["groups_with_followers"] == 19
    assert len(report["leaders"]) == 21 and report["followers"] == 57
    assert round(report["bytes_per_extra_ubatch"] / 2**20) == 216
    text = cli("memory", "--preset", "glm-5.3").stdout
    assert "G = 19" in text and "216.2 MiB" in text


def test_memory_matches_the_builders_allocation(fake_gpu, tmp_path):
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "num_hidden_layers": 11,
        "index_topk": 128,
        "index_topk_freq": 3,
        "index_skip_topk_offset": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # The demo stack's builder: 32 batched tokens, 8 decode rows.
    stack = SharedTopkStack(leader_mask(config), num_ubatches=3)
    allocated = ubatch_topk_bytes(stack.builder.follower_groups)
    result = cli(
        "memory", "--config", str(tmp_path), "--max-num-batched-tokens", "32",
        "--max-num-seqs", "8", "--num-ubatches", "3", "--json",
    )
    report = json.loads(result.stdout)
    assert report["groups_with_followers"] == len(stack.builder.follower_groups)
    assert report["bytes_total"] == allocated > 0


def test_memory_without_dbo_or_followers_is_zero(tmp_path):
    assert "0 bytes (no DBO)" in cli("memory", "--preset", "glm-5.3", "--num-ubatches", "1").stdout
    config = {"num_hidden_layers": 61, "index_topk": 2048}  # DeepSeek-V3.2: freq 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = cli("memory", "--config", str(tmp_path / "config.json"))
    assert result.returncode == 0 and "G = 0" in result.stdout
    assert "0 bytes (no layer reuses another's top-k)" in result.stdout


@pytest.mark.parametrize(
    "content, args, message",
    [
        (None, ["--config", "/nonexistent/config.json"], "cannot read"),
        ("{not json", [], "is not valid JSON"),
        ("[1, 2]", [], "is not a JSON object"),
        ('{"num_hidden_layers": 4}', [], "not a DeepSeek Sparse Attention config"),
        ('{"num_hidden_layers": 0, "index_topk": 64}', [], "num_hidden_layers must be a positive integer"),
    ],
)
def test_memory_bad_config(tmp_path, content, args, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
        args = ["--config", str(tmp_path)]
    result = cli("memory", *args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    "flag, value", [("--max-num-batched-tokens", "0"), ("--max-num-seqs", "-3"),
                    ("--num-speculative-tokens", "-1"), ("--num-ubatches", "two")],
)
def test_memory_bad_sizes(flag, value):
    result = cli("memory", "--preset", "glm-5.3", flag, value)
    assert result.returncode == 2
    assert flag in result.stderr


def test_demo_shows_the_corruption_and_the_fix():
    result = cli("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    stock, fixed = result.stdout.split("with vllm-dsa-dbo:", 1)
    wrong = re.findall(r"layer (\d) \(follows \d\), microbatch (\d).*\[WRONG\]", stock)
    # Every follower of microbatch 0 after the first yield (layer 3 precedes it).
    assert sorted(wrong) == [("4", "0"), ("5", "0"), ("7", "0")]
    assert "[WRONG]" not in fixed
    assert "0 of 16 top-k reads came from the wrong microbatch" in fixed


def test_startup_line_names_what_was_allocated(fake_gpu):
    from vllm_dsa_dbo.patches.base_loader import describe

    stack = SharedTopkStack([True, True, False], num_ubatches=2)
    model = nn.ModuleList([attention_module(impl, stack.buffer) for impl in stack.impls])
    line = describe(model)
    allocated = ubatch_topk_bytes(stack.builder.follower_groups)
    assert line is not None
    assert f"2 microbatches, 1 index groups with followers, {allocated:,} bytes" in line
    without = SharedTopkStack([True, True, False], num_ubatches=1)
    assert describe(nn.ModuleList([attention_module(i, without.buffer) for i in without.impls])) is None
