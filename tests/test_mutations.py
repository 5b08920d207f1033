"""The core test fails when any part of the fix is removed from the source.

Each mutation edits a copy of the package and runs the core test against it
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

MUTATIONS = {
    "index group always returns microbatch 0's state": (
        "ubatch_topk.py",
        "    if ubatch_id == 0 or not group.ubatch_topk_states:\n",
        "    if True:\n",
    ),
    "impl not wired to the per-microbatch logical buffers": (
        "patches/sparse_mla_attention.py",
        '    return resolve_logical_topk(getattr(self, "index_group", None), buffer)\n',
        "    return buffer\n",
    ),
    "leader's writers not wired to the impl's buffer": (
        "patches/deepseek_v32_attention.py",
        "    target.DeepseekV32Attention.topk_indices_buffer = property(_get, _set)\n",
        "    pass\n",
    ),
}


def run_core_test(package_root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", CORE_TEST],
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


def test_core_test_passes_on_unmutated_copy(tmp_path):
    copy_package(tmp_path)
    result = run_core_test(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("name", MUTATIONS)
def test_core_test_fails_under_mutation(name, tmp_path):
    path, old, new = MUTATIONS[name]
    target = copy_package(tmp_path) / path
    source = target.read_text()
    assert source.count(old) == 1, f"mutation site for {name!r} moved"
    target.write_text(source.replace(old, new))

    result = run_core_test(tmp_path)

    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "AssertionError" in result.stdout
    assert "1 failed" in result.stdout
