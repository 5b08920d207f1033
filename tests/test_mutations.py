"""The core test (and the HYV4, ROCm DSA, compiled DSA, sparse MLA backend and DeepSeek-V4.1
tests for their patches) fails when any part of the fix is removed from the source.

Each mutation edits a copy of the package and runs its test against it
in a fresh interpreter, as a reviewer would check it by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_dsa_dbo

REPO = Path(__file__).resolve().parents[1]
CORE_TEST = (
    "tests/test_dbo_ubatch.py::test_dbo_ubatch_followers_read_their_own_leaders_topk"
)
HYV4_TEST = "tests/test_hy_v4.py::test_hy_v4_followers_read_their_own_leaders_topk"
ROCM_TEST = "tests/test_rocm_dsa.py::test_rocm_dsa_followers_read_their_own_leaders_topk"
COMPILED_TEST = "tests/test_deepseek_v2.py::test_compiled_dsa_followers_read_their_own_leaders_topk"
V41_TEST = (
    "tests/test_deepseek_v41.py::test_deepseek_v41_reusing_layers_read_their_own_ubatch_state"
)
TRACED_TEST = "tests/test_deepseek_v2.py::test_traced_code_reads_microbatch_0s_group_state"
BACKENDS = "tests/test_sparse_mla_backends.py"
BACKEND_TEST = f"{BACKENDS}::test_followers_read_their_own_leaders_topk"
FA3_TEST = f"{BACKEND_TEST}[FLASH_ATTN_MLA_SPARSE-auto-decode-16h]"
FLASHMLA_FP8_TEST = f"{BACKEND_TEST}[FLASHMLA_SPARSE-fp8_ds_mla-mixed-16h]"
SM90_TEST = f"{BACKEND_TEST}[FLASHINFER_MLA_SPARSE_SM90-auto-mixed-16h]"
XPU_TEST = f"{BACKENDS}::test_xpu_followers_share_one_buffer_and_are_refused"

MUTATIONS = {
    "index group always returns microbatch 0's state": (
        "ubatch_topk.py",
        "            if ubatch_id and group.ubatch_topk_states:\n",
        "            if False:\n",
        CORE_TEST,
    ),
    "impl not wired to the per-microbatch logical buffers": (
        "patches/sparse_mla_attention.py",
        '    return resolve_logical_topk(getattr(self, "index_group", None), buffer)\n',
        "    return buffer\n",
        CORE_TEST,
    ),
    "leader's writers not wired to the impl's buffer": (
        "patches/deepseek_v32_attention.py",
        "    target.DeepseekV32Attention.topk_indices_buffer = property(_get, _set)\n",
        "    pass\n",
        CORE_TEST,
    ),
    "HYV4 indexer op left as vLLM's": (
        "patches/hy_v4_attention.py",
        "    target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)\n",
        "    pass\n",
        HYV4_TEST,
    ),
    "HYV4 model not wired": (
        "patches/hy_v4_model.py",
        "    call_after_init(target.HYV4Model, keep_logical_topk_per_ubatch)\n",
        "        pass\n",
        HYV4_TEST,
    ),
    "indexer op writes microbatch 0's buffer (HYV4)": (
        "ubatch_topk.py",
        "            return resolve_logical_topk(self.index_group, self._topk_indices_buffer)\n",
        "            return self._topk_indices_buffer\n",
        HYV4_TEST,
    ),
    "ROCm DSA indexer op left as vLLM's": (
        "patches/rocm_dsa_attention.py",
        "    target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)\n",
        "    pass\n",
        ROCM_TEST,
    ),
    "ROCm DSA model not wired": (
        "patches/rocm_dsa_model.py",
        "    call_after_init(target.DeepseekV32Model, keep_logical_topk_per_ubatch)\n",
        "        pass\n",
        ROCM_TEST,
    ),
    "leaders' indexer ops not given their group (ROCm DSA)": (
        "ubatch_topk.py",
        "        op.index_group = group\n",
        "        pass\n",
        ROCM_TEST,
    ),
    "indexer op writes microbatch 0's buffer (ROCm DSA)": (
        "ubatch_topk.py",
        "            return resolve_logical_topk(self.index_group, self._topk_indices_buffer)\n",
        "            return self._topk_indices_buffer\n",
        ROCM_TEST,
    ),
    "indexer op body left as vLLM's (compiled DSA)": (
        "patches/sparse_attn_indexer.py",
        "    cell.cell_contents = per_ubatch_indexer_kernel(cell.cell_contents)\n",
        "    pass\n",
        COMPILED_TEST,
    ),
    "indexer op body writes microbatch 0's buffer (compiled DSA)": (
        "ubatch_topk.py",
        "        if _UBATCH_ID_OF_THREAD and INDEXER_OP_LEADERS:\n",
        "        if False:\n",
        COMPILED_TEST,
    ),
    "compiled DSA layers not wired": (
        "patches/mla.py",
        "    call_after_init(target.MultiHeadLatentAttentionWrapper, wire)\n",
        "    pass\n",
        COMPILED_TEST,
    ),
    "traced code looks the microbatch up (graph break under fullgraph)": (
        "ubatch_topk.py",
        "        if _UBATCH_ID_OF_THREAD and not is_dynamo_compiling():\n",
        "        if _UBATCH_ID_OF_THREAD:\n",
        TRACED_TEST,
    ),
    "extra microbatches wait on their own, never-recorded event (compiled DSA)": (
        "ubatch_topk.py",
        "        state.logical_topk_ready = group.logical_topk_ready\n",
        "        pass\n",
        COMPILED_TEST,
    ),
    "model not wired (DSv41)": (
        "patches/deepseek_v41_model.py",
        "    call_after_init(target.DeepseekV4Model, keep_index_state_per_ubatch)\n",
        "    pass\n",
        V41_TEST,
    ),
    "candidate blocks get no copies (DSv41)": (
        "patches/deepseek_v41_model.py",
        "        buffers.append(model.candidate_block_buffer)\n",
        "        pass\n",
        V41_TEST,
    ),
    "buffers always resolve to microbatch 0's (DSv41)": (
        "ubatch_buffers.py",
        "    return buffer if entry is None else entry[1][ubatch_id - 1]\n",
        "    return buffer\n",
        V41_TEST,
    ),
    "attention layers read vLLM's buffers (DSv41)": (
        "patches/deepseek_v41_attention.py",
        "    per_ubatch_buffers(target.DeepseekV4Attention, "
        '"topk_indices_buffer", "candidate_block_buffer")\n',
        "    pass\n",
        V41_TEST,
    ),
    "indexer op writes vLLM's top-k buffer (DSv41)": (
        "patches/deepseek_v41_attention.py",
        "    indexer.attn_cls = per_ubatch_op(indexer.attn_cls)\n",
        "    pass\n",
        V41_TEST,
    ),
    "indexer op reads vLLM's candidate blocks (DSv41)": (
        "patches/deepseek_v41_attention.py",
        'OP_BUFFERS = ("topk_indices_buffer", "candidate_blocks")\n',
        'OP_BUFFERS = ("topk_indices_buffer",)\n',
        V41_TEST,
    ),
    "index group always returns microbatch 0's state (FLASH_ATTN_MLA_SPARSE)": (
        "ubatch_topk.py",
        "            if ubatch_id and group.ubatch_topk_states:\n",
        "            if False:\n",
        FA3_TEST,
    ),
    "leader's writers not wired to the impl's buffer (FLASHMLA_SPARSE fp8)": (
        "patches/deepseek_v32_attention.py",
        "    target.DeepseekV32Attention.topk_indices_buffer = property(_get, _set)\n",
        "    pass\n",
        FLASHMLA_FP8_TEST,
    ),
    "impl not wired to the per-microbatch logical buffers (FLASHINFER_MLA_SPARSE_SM90)": (
        "patches/sparse_mla_attention.py",
        '    return resolve_logical_topk(getattr(self, "index_group", None), buffer)\n',
        "    return buffer\n",
        SM90_TEST,
    ),
    "followers without an index group loaded under DBO (XPU_MLA_SPARSE)": (
        "patches/base_loader.py",
        "        ungrouped := [m for m in model.modules() if reads_topk_without_index_group(m)]\n",
        "        ungrouped := []\n",
        XPU_TEST,
    ),
}


def run_test(package_root: Path, test: str = CORE_TEST) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def copy_package(root: Path) -> Path:
    copy = root / "vllm_dsa_dbo"
    shutil.copytree(Path(vllm_dsa_dbo.__file__).parent, copy)
    return copy


@pytest.mark.parametrize(
    "test",
    [CORE_TEST, HYV4_TEST, ROCM_TEST, COMPILED_TEST, FA3_TEST, XPU_TEST, V41_TEST],
    ids=str,
)
def test_core_test_passes_on_unmutated_copy(test, tmp_path):
    copy_package(tmp_path)
    result = run_test(tmp_path, test)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("name", MUTATIONS)
def test_core_test_fails_under_mutation(name, tmp_path):
    path, old, new, test = MUTATIONS[name]
    target = copy_package(tmp_path) / path
    source = target.read_text()
    assert source.count(old) == 1, f"mutation site for {name!r} moved"
    target.write_text(source.replace(old, new))

    result = run_test(tmp_path, test)

    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "AssertionError" in result.stdout
    assert "1 failed" in result.stdout
