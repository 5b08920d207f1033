"""`vllm-dsa-dbo upstream-patch`: a vLLM 0.33.0 tree that carries the fix natively.

The small trees hold the files the fix touches, taken from the installed vLLM
0.33.0 (whose Python sources are the sdist's), with the rest of the installed
vLLM linked in (upstream_tree.py). The sdist test patches the whole released
source tree and runs vLLM's own tests in it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import upstream_tree
import vllm_sdist
from test_cli import cli
from test_vllm_own_tests import VLLM_TESTS
from vllm_dsa_dbo import upstream
from vllm_dsa_dbo.cli import main

NEW_TEST = upstream.NEW_TEST


def small_tree(root: Path, link: bool = False) -> Path:
    """The files the fix touches, from the installed vLLM; with `link`, the rest linked in."""
    installed = upstream_tree.installed_vllm()
    for path in upstream.EDITS:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed.parent / path, target)
    (root / NEW_TEST).parent.mkdir(parents=True)
    if link:
        upstream_tree.link_installed(installed, root / "vllm")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def run_tree_tests(root: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest in `root` with its `vllm/` first on the path and no plugin loaded."""
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep + path if path else ''}",
        "VLLM_PLUGINS": "",
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dbo_ubatch_passes_in_the_patched_tree(tmp_path):
    tree = small_tree(tmp_path, link=True)
    assert main(["upstream-patch", str(tree)]) == 0
    result = run_tree_tests(tree, NEW_TEST, "-k", "dbo_ubatch")
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    assert "4 passed" in result.stdout, output


IN_TREE = """
import json
import torch
import vllm_dsa_dbo
from vllm_dsa_dbo import patches
from vllm_dsa_dbo.diagnostics.refusals import left_shared
from vllm_dsa_dbo.testing import cpu_dbo

vllm_dsa_dbo.register()
from vllm.model_executor.model_loader import utils
from vllm.models.deepseek_v32 import attention
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

refused = {}
with cpu_dbo.cpu_vllm(), cpu_dbo.fake_streams():
    for count in (None, 2):  # as deepseek_v2.py builds it, as DeepseekV32Model does here
        kwargs = {} if count is None else {"num_ubatches": count}
        builder = SparseMLAIndexGroupBuilder(torch.empty(16, 8, dtype=torch.int32), 4, **kwargs)
        group, _ = builder.register_layer(True)
        builder.register_layer(False)
        refused[str(count)] = left_shared(group, 2)
print("TREE " + json.dumps({
    "carried": sorted(patches.CARRIED),
    "unapplied": sorted(n for n, r in patches._OUTCOMES.items() if r),
    "load_check": patches.applied(utils),
    "refused": refused,
}))
"""


def test_plugin_in_a_patched_tree_retires_only_what_the_tree_carries(tmp_path):
    """In a tree made by upstream-patch, the plugin retires the three patches the tree
    carries, keeps its load-time check, and leaves the patches built on its own
    index_group unapplied: their paths' builders get one microbatch and are refused."""
    tree = small_tree(tmp_path, link=True)
    assert main(["upstream-patch", str(tree)]) == 0
    env = {k: v for k, v in upstream_tree.tree_env(tree).items() if not k.startswith("VLLM_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True
        )

    result = run("-c", IN_TREE)
    line = next((x for x in result.stdout.splitlines() if x.startswith("TREE ")), None)
    assert line is not None, result.stderr[-3000:]
    found = json.loads(line.removeprefix("TREE "))
    carried = ["deepseek_v32_attention", "index_group", "sparse_mla_attention"]
    assert found["carried"] == carried
    assert found["unapplied"] == ["mla", "sparse_attn_indexer"]
    assert found["load_check"] == ["base_loader"]
    assert found["refused"] == {"None": True, "2": False}

    status = run("-m", "vllm_dsa_dbo.cli", "status")
    out = status.stdout
    assert status.returncode == 1, out + status.stderr[-3000:]
    assert out.count("CARRIED by this vLLM, so not applied") == 3
    assert "SparseMLAIndexGroupBuilder takes num_ubatches, default 1" in out
    assert "this vLLM carries index_group, sparse_mla_attention, deepseek_v32_attention" in out
    assert "the plugin applies " in out and "base_loader, tensorizer" in out
    assert (
        "LEFT UNAPPLIED here: needs the plugin's index_group, which this vLLM carries in its "
        "own form" in out
    )


def test_inserted_code_is_the_core_and_the_model_passes_the_microbatch_count(tmp_path):
    changes = upstream.plan(small_tree(tmp_path))
    core = upstream.module_source(upstream.CORE)
    bound = upstream.top_level(core)
    index_group = changes[upstream.INDEX_GROUP][1]
    for name in upstream.TAKEN[upstream.INDEX_GROUP]:
        assert upstream.statement_text(core, bound[name]) in index_group, name
    model = ast.parse(changes[upstream.DSV32_MODEL][1])
    calls = [
        n
        for n in ast.walk(model)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "SparseMLAIndexGroupBuilder"
    ]
    assert [ast.unparse(k) for c in calls for k in c.keywords] == [
        "num_ubatches=get_num_ubatches(vllm_config.parallel_config)"
    ]
    assert (
        "\nfrom vllm.v1.worker.ubatch_utils import get_num_ubatches\n"
        in (changes[upstream.DSV32_MODEL][1])
    )


def test_diff_applies_with_git_and_dry_run_writes_nothing(tmp_path, capsys):
    tree = small_tree(tmp_path / "tree")
    before = snapshot(tree)
    assert main(["upstream-patch", "--dry-run", str(tree)]) == 0
    diff = capsys.readouterr().out
    assert snapshot(tree) == before
    assert diff.count("diff --git a/") == len(upstream.EDITS) + 1
    (tmp_path / "fix.diff").write_text(diff)
    # Outside a repository `git apply` works as `patch` does, on the files under cwd.
    subprocess.run(["git", "apply", "--check", str(tmp_path / "fix.diff")], cwd=tree, check=True)
    out = tmp_path / "copy"
    assert main(["upstream-patch", "--out", str(out), str(tree)]) == 0
    assert snapshot(tree) == before
    assert snapshot(out) == {
        **before,
        **{p: new.encode() for p, (_, new) in upstream.plan(tree).items()},
    }


@pytest.mark.parametrize(
    "path, old, new, place",
    [
        (
            upstream.INDEX_GROUP,
            "    def register_layer(\n        self,\n        is_index",
            "    def add_layer(\n        self,\n        is_index",
            "SparseMLAIndexGroupBuilder.register_layer",
        ),
        (
            upstream.SPARSE_MLA,
            "    @property\n    def topk_indices_buffer",
            "    def topk_indices_buffer",
            "SharedTopkIndicesBuffer.topk_indices_buffer",
        ),
        (
            upstream.DSV32_MODEL,
            "        index_group_builder = SparseMLAIndexGroupBuilder(",
            "        index_group_builder = make_builder(",
            "SparseMLAIndexGroupBuilder(...)",
        ),
    ],
    ids=["builder method renamed", "getter no property", "model builds no builder"],
)
def test_tree_missing_a_place_is_refused_and_nothing_written(
    tmp_path, capsys, path, old, new, place
):
    tree = small_tree(tmp_path)
    file = tree / path
    assert file.read_text().count(old) == 1
    file.write_text(file.read_text().replace(old, new))
    before = snapshot(tree)
    assert main(["upstream-patch", str(tree)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and place in err and "nothing written" in err, err
    assert snapshot(tree) == before


def test_already_patched_tree_is_refused_and_nothing_written(tmp_path, capsys):
    tree = small_tree(tmp_path)
    assert main(["upstream-patch", str(tree)]) == 0
    capsys.readouterr()
    before = snapshot(tree)
    assert main(["upstream-patch", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "already" in err and "the tree carries the fix" in err and "nothing written" in err
    assert snapshot(tree) == before
    # Each file alone: a tree patched in part is refused too.
    for path in upstream.EDITS:
        partial = small_tree(tmp_path / path.replace("/", "_"))
        shutil.copyfile(tree / path, partial / path)
        with pytest.raises(upstream.PatchRefused, match="carries the fix"):
            upstream.plan(partial)


@pytest.mark.parametrize("what", ["not a directory", "no vllm", "file missing", "--out exists"])
def test_bad_source_is_an_error(tmp_path, capsys, what):
    tree = small_tree(tmp_path / "tree")
    args = ["upstream-patch", str(tree)]
    if what == "not a directory":
        args = ["upstream-patch", str(tmp_path / "nowhere")]
    elif what == "no vllm":
        args = ["upstream-patch", str(tmp_path)]
    elif what == "file missing":
        (tree / upstream.DSV32_ATTENTION).unlink()
    else:
        args += ["--out", str(tmp_path)]
    before = snapshot(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "content, message",
    [
        (b"<<<<<<< HEAD\nx = 1\n=======\nx = 2\n>>>>>>> fix\n", "line 1: not valid Python"),
        (b"def f(:\n    pass\n", "line 1: not valid Python: invalid syntax"),
        (b"x = '\xe9'\n", "byte 5: not UTF-8 text (invalid continuation byte)"),
        (b"x = 1\0\n", "not valid Python: source code string cannot contain null bytes"),
    ],
    ids=["conflict markers", "syntax error", "latin-1 byte", "null byte"],
)
def test_tree_with_a_file_that_is_not_python_is_refused(tmp_path, content, message):
    """A tree whose file is not UTF-8 Python: one error line naming the file, exit 2."""
    tree = small_tree(tmp_path / "tree")
    (tree / upstream.DSV32_MODEL).write_bytes(content)
    before = snapshot(tmp_path)
    result = cli("upstream-patch", str(tree))
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    assert f"{upstream.DSV32_MODEL}: " in result.stderr and message in result.stderr, result.stderr
    assert snapshot(tmp_path) == before


def test_out_that_cannot_be_written_is_an_error(tmp_path):
    tree = small_tree(tmp_path / "tree")
    (tmp_path / "file").write_text("")
    result = cli("upstream-patch", "--out", str(tmp_path / "file" / "copy"), str(tree))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"error: cannot write the patched tree to {tmp_path / 'file' / 'copy'}: "
    )


def test_released_tree_patched_passes_dbo_ubatch_and_vllm_tests_unchanged(tmp_path):
    """The sdist patched: the new test passes there and fails unpatched; vLLM's
    own CPU tests (test_vllm_own_tests.py) give the same outcomes."""
    try:
        unpatched, patched = upstream_tree.prepare(tmp_path)
    except vllm_sdist.SdistUnavailable as e:
        pytest.skip(f"vLLM's sdist not available: {e}")
    assert upstream_tree.imports_from(patched) == str(patched / "vllm" / "__init__.py")
    shutil.copyfile(patched / NEW_TEST, unpatched / NEW_TEST)
    args = [NEW_TEST, *VLLM_TESTS]
    with ThreadPoolExecutor(2) as pool:
        (_, before), (summary, after) = pool.map(
            lambda root: upstream_tree.run(root, args), (unpatched, patched)
        )
    new = {t for t in after if t.startswith("tests.v1.attention.test_sparse_mla_dbo_ubatch")}
    assert len(new) == 4 and all("dbo_ubatch" in t for t in new), sorted(after)
    assert {after[t] for t in new} == {"passed"}, summary
    assert {before[t] for t in new} <= {"failure", "error"}, before
    own = {t: o for t, o in after.items() if t not in new}
    assert own and set(own.values()) <= {"passed", "skipped"} and "passed" in own.values()
    assert own == {t: o for t, o in before.items() if t not in new}
