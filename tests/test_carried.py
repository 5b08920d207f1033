"""What a vLLM carries of the upstream change, told by the structure of its code: no seam of
the release, every seam of the tree upstream-patch writes, and no seam where a line only reads
the impl's buffer while the writers still take their own."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import fresh
import upstream_tree
from test_upstream_patch import (  # noqa: F401 (released: a fixture)
    CHANGE,
    DSV32_ATTENTION,
    patched_tree,
    released,
    small_tree,
)
from vllm_dsa_dbo import carried

pytestmark = pytest.mark.skipif(CHANGE is None, reason="the change has no data for this vLLM")

# A method of DeepseekV32Attention that reads the impl's buffer and hands it to nothing.
DEAD_READ = "    def dead_read(self):\n        return self.impl.topk_indices_buffer\n\n"


def seams_of_the_change() -> set[str]:
    """The seams whose files the change edits in this release."""
    return {name for name, seam in carried.SEAMS.items() if seam.path in CHANGE.edits}


def with_dead_read(root: Path) -> Path:
    """`root` with `DEAD_READ` in DeepseekV32Attention, its writers as they were."""
    file = root / DSV32_ATTENTION
    text = file.read_text()
    at = re.search(r"^class DeepseekV32Attention\b.*?\n(?=    def )", text, re.S | re.M)
    assert at is not None
    file.write_text(text[: at.end()] + DEAD_READ + text[at.end() :])
    return root


def test_a_released_tree_carries_no_seam(released, tmp_path):  # noqa: F811
    found = carried.found_in(small_tree(released, tmp_path))
    assert found.keys() == seams_of_the_change()
    assert not any(found.values()), found


def test_the_tree_upstream_patch_writes_carries_every_seam(released, tmp_path):  # noqa: F811
    found = carried.found_in(patched_tree(released, tmp_path))
    assert found.keys() == seams_of_the_change()
    assert all(found.values()), found


def test_a_dead_read_of_the_impls_buffer_carries_nothing(released, tmp_path):  # noqa: F811
    found = carried.found_in(with_dead_read(small_tree(released, tmp_path)))
    assert found["deepseek_v32_attention"] is False


def test_a_tree_with_one_writer_as_released_does_not_carry_the_attention(
    released,  # noqa: F811
    tmp_path,
):
    tree = patched_tree(released, tmp_path)
    file = tree / DSV32_ATTENTION
    text = file.read_text()
    file.write_text(text.replace("self.impl.topk_indices_buffer", "self.topk_indices_buffer", 1))
    assert carried.found_in(tree)["deepseek_v32_attention"] is False


def test_status_check_in_a_tree_with_a_dead_read_reports_the_seam_changed(
    released,  # noqa: F811
    tmp_path,
):
    """The seam is neither the release's nor the change's: its patch is left unapplied, GLM-5
    is refused under DBO at load, and status says the fix is not active."""
    tree = with_dead_read(small_tree(released, tmp_path, link=True))
    env = {k: v for k, v in upstream_tree.tree_env(tree).items() if not k.startswith("VLLM_")}
    result: subprocess.CompletedProcess = fresh.python(
        ["-m", "vllm_dsa_dbo.cli", "status", "--check"], env, cwd=tree
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr[-3000:]
    assert "CARRIED" not in out, out
    block = out.partition("vllm.models.deepseek_v32.attention: ")[2]
    assert "LEFT UNAPPLIED here: vllm.models.deepseek_v32.attention differs from vLLM" in block
    assert "fix NOT active: patch deepseek_v32_attention is left unapplied" in out, out
