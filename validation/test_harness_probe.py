"""The harness's worker probe on CPU: what a GPU run's JSON says about the fix.

Stock runs keep the isolation checker on, whose own patch marks vLLM's index-group module too;
the probe must still report the fix as off there, and must not read microbatch state the stock
groups lack.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fresh

# One worker's snapshot over a GLM-5-shaped stack of vLLM's sparse MLA layers, built as
# `register()` leaves vLLM under the environment of the run.
PROBE = """
import json, sys
from types import SimpleNamespace
import torch
from vllm_dsa_dbo.demo import use_cpu
use_cpu()
import vllm_dsa_dbo
from vllm_dsa_dbo.diagnostics.layout import leader_mask
from vllm_dsa_dbo import cpu_dbo
from vllm_dsa_dbo.cpu_dbo import GLM5_LAYOUT, SharedTopkStack
from dsa_dbo_harness.worker_probe import snapshot

vllm_dsa_dbo.register()
fixed = sys.argv[1] == "fixed"
with cpu_dbo.cpu_vllm():
    stack = SharedTopkStack(leader_mask(GLM5_LAYOUT), 2 if fixed else None)
    model = torch.nn.ModuleList(a for a in stack.attns if a is not None)
    cache = SimpleNamespace(cache_dtype="auto", enable_prefix_caching=False, num_gpu_blocks=1)
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(model=model, model_memory_usage=0), cache_config=cache
    )
    print("SNAPSHOT " + json.dumps(snapshot(worker)))
"""


def probe(phase: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env |= {
        "VLLM_DSA_DBO_CHECK": "audit",
        "VLLM_DSA_DBO_DISABLE": "stock" if phase == "stock" else "",
    }
    result = fresh.python(["-c", PROBE, phase], env, cwd=Path(__file__).parent, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(s for s in result.stdout.splitlines() if s.startswith("SNAPSHOT "))
    return json.loads(line.removeprefix("SNAPSHOT "))


@pytest.mark.parametrize("phase", ["stock", "fixed"])
def test_probe_reports_the_fix_only_where_it_is_in_force(phase):
    snap = probe(phase)
    fixed = phase == "fixed"
    assert snap["plugin_patched"] is fixed
    assert snap["isolation_check"]["mode"] == "audit"
    assert snap["index_groups"] == 4
    assert (snap["groups_with_followers"] > 0) is fixed
    assert (snap["ubatch_topk_bytes"] > 0) is fixed
