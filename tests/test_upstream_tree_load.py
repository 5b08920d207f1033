"""The plugin in a vLLM that carries the upstream change, as `vllm-dsa-dbo upstream-patch`
writes it, whole or in part: GLM-5 loads with and without DBO, and its DBO step reads no other
microbatch's top-k, or it is refused under DBO by a message that names what the tree lacks;
the paths the change leaves out stay fixed by the plugin, on the tree's own state.

The tree is test_upstream_patch.py's: the released files the change touches, patched, with the
installed vLLM's others linked in; the run imports vLLM from it, with the plugin registered.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import pytest

import fresh
import upstream_tree
import vllm_sdist
from test_upstream_patch import (  # noqa: F401 (released: a fixture)
    DSV32_ATTENTION,
    INDEX_GROUP,
    MISTRAL_ATTENTION,
    SPARSE_MLA,
    patched_tree,
    released,
    small_tree,
)
from vllm_dsa_dbo import upstream

CHANGE = upstream.RELEASES.get(vllm_sdist.VERSION)
pytestmark = pytest.mark.skipif(
    CHANGE is None, reason=f"the change has no data for vLLM {vllm_sdist.VERSION}"
)

# GLM-5's stack (leader, two followers) built by initialize_model; per path (argv: name,
# whether its model passes the run's microbatch count as the tree's DeepseekV32Model does,
# whether its leaders' writers take the impl's buffer as the tree's DeepseekV32Attention's
# do), without and with DBO. Then the DBO step, and which Mistral modules the run imported.
LOAD_IN_TREE = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from vllm_dsa_dbo.demo import use_cpu
use_cpu()
import vllm_dsa_dbo
vllm_dsa_dbo.register()
import torch.nn as nn
from types import SimpleNamespace
from vllm.config import CompilationMode
from vllm.model_executor.model_loader import utils
from vllm.v1.attention.backends.mla import index_group
from vllm.v1.worker.ubatch_utils import get_num_ubatches
from vllm_dsa_dbo import cpu_dbo
from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, attention_module


def builder(buffer, max_decode_rows, num_ubatches=None):
    # As the tree's DeepseekV32Model passes the count: third, by position.
    counted = () if num_ubatches is None else (num_ubatches,)
    return index_group.SparseMLAIndexGroupBuilder(buffer, max_decode_rows, *counted)


cpu_dbo.SparseMLAIndexGroupBuilder = builder


class TreeStack(SharedTopkStack):
    def lead(self, layer, logical):
        self.impls[layer].topk_indices_buffer[: logical.shape[0]] = logical
        self.impls[layer].record_logical_topk_ready()


stacks = []


def model(counted, impl_writers):
    class Model(nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            count = get_num_ubatches(vllm_config.parallel_config) if counted else None
            stack = (TreeStack if impl_writers else SharedTopkStack)([True, False, False], count)
            stacks.append(stack)
            self.layers = nn.ModuleList(
                attn or attention_module(impl, stack.buffer)
                for attn, impl in zip(stack.attns, stack.impls)
            )

    return Model


with cpu_dbo.cpu_vllm() as config, cpu_dbo.fake_streams():
    config.compilation_config.mode = CompilationMode.NONE
    for path in sys.argv[1:]:
        name, counted, impl_writers = path.split(",")
        for dbo in (False, True):
            config.parallel_config.enable_dbo = dbo
            try:
                utils.initialize_model(
                    config,
                    model_class=model(counted == "counted", impl_writers == "impl"),
                    model_config=SimpleNamespace(hf_config=None),
                )
                print("LOADED", name, dbo)
                if dbo:
                    reads = stacks[-1].run_step()
                    print("READS", name, [(r.layer, r.ubatch) for r in reads if not r.ok])
            except ValueError as e:
                print("REFUSED", name, dbo, " ".join(str(e).split()))
print("IMPORTED", sorted(m for m in sys.modules if m.startswith("vllm.models.mistral")))
"""


def run_in_tree(tree: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c script args` importing vLLM from `tree`, the plugin's tests importable."""
    env = {k: v for k, v in upstream_tree.tree_env(tree).items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).parent)
    return fresh.python(["-c", script, *args], env, cwd=tree)


def test_glm5_loads_in_a_patched_tree_with_and_without_dbo(released, tmp_path):  # noqa: F811
    """GLM-5 loads with and without DBO in a whole tree and reads only its own microbatch's
    top-k; a model whose builder nothing gives the count, and whose leaders nothing wires,
    loads without DBO and is refused with it."""
    tree = patched_tree(released, tmp_path, link=True)
    result = run_in_tree(tree, LOAD_IN_TREE, "dsv32,counted,impl", "uncounted,,impl")
    out, log = result.stdout, result.stderr
    assert result.returncode == 0 and "Traceback" not in log, out + log[-3000:]
    assert "LOADED dsv32 False" in out and "LOADED dsv32 True" in out, out
    assert "READS dsv32 []" in out, out
    assert "Model keeps shared top-k per DBO microbatch: 2 microbatches" in log
    assert "LOADED uncounted False" in out
    assert "REFUSED uncounted True vllm-dsa-dbo: Model shares top-k between layers" in out


# The plugin's tests of the paths the change leaves out: each builds that path's vLLM classes
# and runs a DBO step, or refuses the path left unwired.
LEFT_OUT = (
    "test_patch_mla.py::test_compiled_dsa_followers_read_their_own_leaders_topk",
    "test_patch_mla.py::test_compiled_dsa_off_cuda_is_refused",
    "test_patch_mla.py::test_traced_code_reads_microbatch_0s_group_state",
    "test_patch_hy_v4.py::test_hy_v4_followers_read_their_own_leaders_topk",
    "test_patch_hy_v4.py::test_hy_v4_unwired_followers_are_refused",
    "test_patch_rocm_dsa.py::test_rocm_dsa_followers_read_their_own_leaders_topk",
    "test_patch_rocm_dsa.py::test_rocm_dsa_unwired_followers_are_refused",
    "test_patch_deepseek_v41.py::test_deepseek_v41_reusing_layers_read_their_own_ubatch_state",
)
RUN_TESTS = """
import sys
import pytest
code = pytest.main(sys.argv[1:])
from vllm_dsa_dbo import patches
print("CARRIED", sorted(patches.CARRIED))
print("UNAPPLIED", sorted(name for name, why in patches._OUTCOMES.items() if why))
sys.exit(code)
"""


def test_the_paths_the_change_leaves_out_stay_fixed_on_the_trees_state(
    released,  # noqa: F811
    tmp_path,
):
    """In a whole tree, the plugin's tests of the compiled deepseek_v2 path, HYV4, ROCm DSA and
    DeepSeek-V4.1 pass: each DBO step reads only its own microbatch's top-k, kept in vLLM's own
    per-microbatch state where the tree keeps it, and each path left unwired is refused."""
    tree = patched_tree(released, tmp_path, link=True)
    here = Path(__file__).parent
    pytest_args = ["-c", str(here.parent / "pyproject.toml"), "--rootdir", str(here.parent)]
    pytest_args += ["-n", "0", "-q", "-p", "no:cacheprovider", *(str(here / t) for t in LEFT_OUT)]
    result = run_in_tree(tree, RUN_TESTS, *pytest_args)
    out = result.stdout
    passed = f"{len(LEFT_OUT)} passed"
    assert result.returncode == 0 and passed in out, out[-3000:] + result.stderr[-3000:]
    assert "CARRIED ['deepseek_v32_attention', 'index_group', 'sparse_mla_attention'" in out
    assert "UNAPPLIED []" in out, out[-3000:]


DSV32_MODEL = "vllm/models/deepseek_v32/nvidia/model.py"
# The change's files GLM-5's stack runs; the others (vLLM 0.34.0's Mistral Large 4 files) it
# never imports, as each run checks.
GLM5_FILES = (INDEX_GROUP, SPARSE_MLA, DSV32_ATTENTION, DSV32_MODEL)
SOURCES = {p for p in CHANGE.edits if p.startswith("vllm/")} if CHANGE else set()
PARTS = [
    pytest.param(part, id="+".join(Path(p).stem for p in part))
    for n in range(1, len(GLM5_FILES) + 1)
    for part in itertools.combinations(GLM5_FILES, n)
    if set(part) != SOURCES
]


@pytest.fixture(scope="module")
def patched_files(released) -> dict[str, str]:  # noqa: F811
    """Each file the change touches, as it leaves it."""
    return {path: new for path, (_, new) in upstream.plan(released).items()}


@pytest.mark.parametrize("part", PARTS)
def test_a_tree_that_carries_the_change_in_part_fixes_glm5_or_refuses_it_naming_the_rest(
    released,  # noqa: F811
    patched_files,
    tmp_path,
    part,
):
    """Each proper subset of the change's files GLM-5 runs: under DBO, either its step reads
    nothing of the other microbatch, or the load is refused naming each file the tree lacks;
    without DBO it loads."""
    tree = small_tree(released, tmp_path, link=True)
    for path in part:
        (tree / path).write_text(patched_files[path])
    model = "counted" if DSV32_MODEL in part else ""
    writers = "impl" if DSV32_ATTENTION in part else "own"
    result = run_in_tree(tree, LOAD_IN_TREE, f"dsv32,{model},{writers}")
    out, log = result.stdout, result.stderr
    assert result.returncode == 0 and "Traceback" not in log, out + log[-3000:]
    assert "LOADED dsv32 False" in out and "IMPORTED []" in out, out
    if "LOADED dsv32 True" in out or set(GLM5_FILES) <= set(part):
        assert "READS dsv32 []" in out, out
        return
    [refusal] = [line for line in out.splitlines() if line.startswith("REFUSED dsv32 True")]
    assert "carries the upstream change (vllm PR #60734) in part" in refusal, refusal
    lacked = refusal.partition("it lacks the change to ")[2]
    assert all(path in lacked for path in set(GLM5_FILES) - set(part)), refusal


# Mistral Large 4 (vLLM 0.34.0) built by the loader under DBO, as test_patch_mistral builds it.
LOAD_MISTRAL = """
from _pytest.monkeypatch import MonkeyPatch
from vllm_dsa_dbo.demo import use_cpu
use_cpu()
import vllm_dsa_dbo
vllm_dsa_dbo.register()
from vllm_dsa_dbo import cpu_dbo
import test_patch_mistral
with cpu_dbo.cpu_vllm() as config, MonkeyPatch.context() as monkeypatch, cpu_dbo.fake_streams():
    try:
        model = test_patch_mistral.build_model(monkeypatch, config, enable_dbo=True, loaded=True)
        print("LOADED")
    except ValueError as e:
        print("REFUSED", " ".join(str(e).split()))
    else:
        reads = test_patch_mistral.MistralStack(model, monkeypatch).run_step()
        print("READS", len(reads), [(r.layer, r.ubatch) for r in reads if not r.ok])
"""
MISTRAL_FILES = (
    "vllm/models/mistral/mistral_large4/nvidia/model.py",
    MISTRAL_ATTENTION,
    "vllm/models/mistral/nvidia/indexer.py",
)
MISTRAL_PARTS = [
    pytest.param(part, id="+".join(Path(p).stem for p in part) or "none")
    for n in range(len(MISTRAL_FILES))
    for part in itertools.combinations(MISTRAL_FILES, n)
]


@pytest.mark.skipif(not set(MISTRAL_FILES) <= SOURCES, reason="the change has no Mistral files")
def test_a_whole_tree_runs_mistral_large_4_under_dbo_reading_its_own_topk(
    released,  # noqa: F811
    tmp_path,
):
    """The whole change carried: Mistral Large 4 loads under DBO with the plugin, and its DBO
    step reads only its own microbatch's top-k, kept by the tree's own code."""
    result = run_in_tree(patched_tree(released, tmp_path, link=True), LOAD_MISTRAL)
    out = result.stdout
    assert result.returncode == 0 and "LOADED" in out, out + result.stderr[-3000:]
    assert "READS 8 []" in out, out


@pytest.mark.skipif(not set(MISTRAL_FILES) <= SOURCES, reason="the change has no Mistral files")
@pytest.mark.parametrize("part", MISTRAL_PARTS)
def test_a_tree_with_mistral_large_4_in_part_refuses_it_under_dbo(
    released,  # noqa: F811
    patched_files,
    tmp_path,
    part,
):
    """The change's core carried, and of Mistral Large 4's files only `part`: the layers from
    the files it lacks would not keep their top-k per microbatch, so Mistral is refused under
    DBO, naming each of those files."""
    tree = small_tree(released, tmp_path, link=True)
    for path in (INDEX_GROUP, SPARSE_MLA, *part):
        (tree / path).write_text(patched_files[path])
    result = run_in_tree(tree, LOAD_MISTRAL)
    out = result.stdout
    assert result.returncode == 0 and "LOADED" not in out, out + result.stderr[-3000:]
    [refusal] = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert "carries the upstream change (vllm PR #60734) in part" in refusal, refusal
    lacked = refusal.partition("it lacks the change to ")[2]
    assert all(path in lacked for path in set(MISTRAL_FILES) - set(part)), refusal


@pytest.mark.skipif(not set(MISTRAL_FILES) <= SOURCES, reason="the change has no Mistral files")
def test_a_tree_with_only_mistral_large_4s_files_leaves_glm5_to_the_plugin(
    released,  # noqa: F811
    patched_files,
    tmp_path,
):
    """GLM-5's files are as released, so the plugin's patches fix it under DBO; Mistral Large 4
    would run the tree's files on the plugin's core, a mix the plugin refuses under DBO."""
    tree = small_tree(released, tmp_path, link=True)
    for path in MISTRAL_FILES:
        (tree / path).write_text(patched_files[path])
    result = run_in_tree(tree, LOAD_IN_TREE, "dsv32,,own")
    out = result.stdout
    assert result.returncode == 0 and "LOADED dsv32 True" in out, out + result.stderr[-3000:]
    assert "READS dsv32 []" in out, out
    mistral = run_in_tree(tree, LOAD_MISTRAL).stdout
    [refusal] = [line for line in mistral.splitlines() if line.startswith("REFUSED")]
    assert "the plugin vouches for all of the change on a model's path or none of it" in refusal
    assert f"{INDEX_GROUP}, {SPARSE_MLA}, which do not" in refusal, refusal
