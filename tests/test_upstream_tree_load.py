"""The plugin in a vLLM that carries the upstream change, as `vllm-dsa-dbo upstream-patch`
writes it: GLM-5 loads with and without DBO, its DBO step reads no other microbatch's top-k,
and the paths the change leaves out are still refused under DBO.

The tree is test_upstream_patch.py's: the released files the change touches, patched, with the
installed vLLM's others linked in; the run imports vLLM from it, with the plugin registered.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import fresh
import upstream_tree
import vllm_sdist
from test_upstream_patch import patched_tree, released  # noqa: F401 (a fixture)
from vllm_dsa_dbo import upstream

pytestmark = pytest.mark.skipif(
    upstream.RELEASES.get(vllm_sdist.VERSION) is None,
    reason=f"the change has no data for vLLM {vllm_sdist.VERSION}",
)

# GLM-5's stack (leader, two followers) built by initialize_model, as the tree's
# DeepseekV32Model builds it (the run's microbatch count) and as the deepseek_v2 path does
# (none); the tree's leader writers take the impl's buffer. Then the DBO step.
LOAD_IN_TREE = """
import logging
logging.basicConfig(level=logging.INFO)
from vllm_dsa_dbo.demo import use_cpu
use_cpu()
import vllm_dsa_dbo
vllm_dsa_dbo.register()
import torch.nn as nn
from types import SimpleNamespace
from vllm.config import CompilationMode
from vllm.model_executor.model_loader import utils
from vllm.v1.worker.ubatch_utils import get_num_ubatches
from vllm_dsa_dbo import cpu_dbo
from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, attention_module


class TreeStack(SharedTopkStack):
    def lead(self, layer, logical):
        self.impls[layer].topk_indices_buffer[: logical.shape[0]] = logical
        self.impls[layer].record_logical_topk_ready()


stacks = []


def model(counted):
    class Model(nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            count = get_num_ubatches(vllm_config.parallel_config) if counted else None
            stacks.append(TreeStack([True, False, False], num_ubatches=count))
            self.layers = nn.ModuleList(
                attention_module(i, stacks[-1].buffer) for i in stacks[-1].impls
            )

    return Model


with cpu_dbo.cpu_vllm() as config, cpu_dbo.fake_streams():
    config.compilation_config.mode = CompilationMode.NONE
    for path, counted in (("dsv32", True), ("dsv2", False)):
        for dbo in (False, True):
            config.parallel_config.enable_dbo = dbo
            try:
                utils.initialize_model(
                    config, model_class=model(counted), model_config=SimpleNamespace(hf_config=None)
                )
                print("LOADED", path, dbo)
                if dbo:
                    reads = stacks[-1].run_step()
                    print("READS", path, [(r.layer, r.ubatch) for r in reads if not r.ok])
            except ValueError as e:
                print("REFUSED", path, dbo, " ".join(str(e).split()))
"""


def run_in_tree(tree: Path, code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in upstream_tree.tree_env(tree).items() if not k.startswith("VLLM_")}
    return fresh.python(["-c", code], env, cwd=tree)


def test_glm5_loads_in_a_patched_tree_with_and_without_dbo(released, tmp_path):  # noqa: F811
    tree = patched_tree(released, tmp_path, link=True)
    result = run_in_tree(tree, LOAD_IN_TREE)
    out, log = result.stdout, result.stderr
    assert result.returncode == 0 and "Traceback" not in log, out + log[-3000:]
    assert "LOADED dsv32 False" in out and "LOADED dsv32 True" in out, out
    assert "READS dsv32 []" in out, out
    assert "Model keeps shared top-k per DBO microbatch: 2 microbatches" in log
    assert "LOADED dsv2 False" in out
    assert "REFUSED dsv2 True vllm-dsa-dbo: Model shares top-k between layers" in out
