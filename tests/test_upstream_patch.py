"""`vllm-dsa-dbo upstream-patch`: a tree of the installed vLLM release that carries the fix
natively, and the command that regenerates the change's data.

The small trees hold the released files the change touches and those vLLM's
pre-commit hooks read, from vLLM's sdist (tests/vllm_sdist.py's cache), with the
rest of the installed vLLM linked in (upstream_tree.py). The sdist test patches
the whole released source tree and runs vLLM's own tests in it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import bare_python
import fresh
import upstream_tree
import vllm_sdist
from test_cli import cli
from vllm_dsa_dbo import patches, upstream
from vllm_dsa_dbo.cli import main
from vllm_dsa_dbo.patches.mistral_attention import PATCH as MISTRAL_PATCH
from vllm_dsa_dbo.upstream import regenerate

CHANGE = upstream.RELEASES.get(vllm_sdist.VERSION)
pytestmark = pytest.mark.skipif(
    CHANGE is None, reason=f"the change has no data for vLLM {vllm_sdist.VERSION}"
)
VERSION = vllm_sdist.VERSION
EDITS = CHANGE.edits if CHANGE else ()
NEW_TESTS = sum(CHANGE.tests.values(), []) if CHANGE else []
RUNNER = Path(__file__).with_name("tree_dbo_ubatch.py")
INDEX_GROUP = "vllm/v1/attention/backends/mla/index_group.py"
SPARSE_MLA = "vllm/model_executor/layers/attention/sparse_mla_attention.py"
DSV32_ATTENTION = "vllm/models/deepseek_v32/attention.py"
MISTRAL_ATTENTION = "vllm/models/mistral/nvidia/attention.py"
MISTRAL_INDEXER = "vllm/models/mistral/nvidia/indexer.py"
ADDED = [p for p in EDITS if upstream.NEW_FILE in CHANGE.files[p]] if CHANGE else []
# What vLLM's hooks read besides the files they check.
HOOK_INPUTS = ("PKG-INFO", "pyproject.toml", ".pre-commit-config.yaml", "tools/", ".buildkite/")
# vLLM's local hooks that check Python files (.pre-commit-config.yaml, repo: local).
LOCAL_HOOKS = (
    "check_spdx_header",
    "check_init_lazy_imports",
    "check_forbidden_imports",
    "check_torch_cuda",
    "check_boolean_context_manager",
    "check_trust_remote_code",
    "validate_config",
    "check_test_tethering",
)


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> Path:
    """The sdist's files the change touches and the hooks read."""
    try:
        sdist = vllm_sdist.fetch()
    except vllm_sdist.SdistUnavailable as e:
        pytest.skip(f"vLLM's sdist not available: {e}")
    dest = tmp_path_factory.mktemp("released")
    root = upstream_tree.extract_files(sdist, dest, (*EDITS, *HOOK_INPUTS))
    for path in ADDED:  # its folder, as in the whole tree
        (root / path).parent.mkdir(parents=True, exist_ok=True)
    return root


def small_tree(released: Path, root: Path, link: bool = False) -> Path:
    """A copy of the released files; with `link`, the installed vLLM's others linked in."""
    shutil.copytree(released, root, dirs_exist_ok=True)
    if link:
        upstream_tree.link_installed(upstream_tree.installed_vllm(), root / "vllm")
    return root


def patched_tree(released: Path, root: Path, link: bool = False) -> Path:
    tree = small_tree(released, root, link)
    assert main(["upstream-patch", str(tree)]) == 0
    return tree


def snapshot(root: Path) -> dict[str, str]:
    """Each file's digest: a failed comparison lists the paths, not the files (pytest's CI mode
    diffs whole values)."""
    return {
        str(p.relative_to(root)): vllm_sdist.sha256(p)
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def run_new_test(root: Path) -> subprocess.CompletedProcess:
    """The change's test, on a CPU, in `root` with its `vllm/` first and no plugin loaded."""
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep + path if path else ''}",
        "VLLM_PLUGINS": "",
    }
    # In that one process: this repository's pytest settings would start two workers.
    args = ["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-n", "0", str(RUNNER)]
    return fresh.python(args, env, cwd=root)


def outcomes(out: str) -> dict[str, set[str]]:
    """The test functions of a `run_new_test` output, by outcome (PASSED, FAILED, ERROR)."""
    found: dict[str, set[str]] = {}
    for outcome, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", out, re.M):
        found.setdefault(outcome, set()).add(name)
    return found


def test_new_test_passes_in_the_patched_tree(released, tmp_path):
    result = run_new_test(patched_tree(released, tmp_path, link=True))
    out = result.stdout
    assert outcomes(out) == {"PASSED": set(NEW_TESTS)}, out[-3000:] + result.stderr[-3000:]


# Each half of the fix taken out of the patched tree, and each leader's writer put back to
# the model's buffer: (file, what the change wrote, instead).
HALVES = {
    "followers read microbatch 0's rows": (
        INDEX_GROUP,
        "        return rows[dbo_current_ubatch_token_offset() :]\n",
        "        return rows\n",
    ),
    "microbatches share microbatch 0's valid counts and events": (
        INDEX_GROUP,
        "        return self.ubatch_topk[dbo_current_ubatch_id()]\n",
        "        return self\n",
    ),
    "the impl's getter reads microbatch 0's logical rows": (
        SPARSE_MLA,
        "        return self.index_group.ubatch_topk_rows(buffer)\n",
        "        return buffer\n",
    ),
    "the builder keeps no per-microbatch state": (
        INDEX_GROUP,
        "        if group_index == 1 and self.num_ubatches > 1:\n",
        "        if False:\n",
    ),
    "DeepseekV32Attention's fused_norm_rope writes the model's buffer": (
        DSV32_ATTENTION,
        "            indexer_k_rope_cos_sin_cache,\n"
        "            self.impl.topk_indices_buffer,  # type: ignore[attr-defined]\n",
        "            indexer_k_rope_cos_sin_cache,\n            self.topk_indices_buffer,\n",
    ),
    "DeepseekV32Attention's sparse_attn_indexer writes the model's buffer": (
        DSV32_ATTENTION,
        "                self.indexer.max_total_seq_len,\n"
        "                self.impl.topk_indices_buffer,  # type: ignore[attr-defined]\n",
        "                self.indexer.max_total_seq_len,\n"
        "                self.topk_indices_buffer,\n",
    ),
    # Mistral Large 4 (vLLM 0.34.0): its leader's wiring and its indexer's hand-off to its op.
    "a Mistral leader hands its indexer the model's buffer": (
        MISTRAL_ATTENTION,
        "            topk_indices_buffer = self.attn.impl.topk_indices_buffer"
        "  # type: ignore[attr-defined]\n",
        "            topk_indices_buffer = indexer.topk_indices_buffer\n",
    ),
    "a Mistral indexer's op writes the model's buffer": (
        MISTRAL_INDEXER,
        "        self.indexer_op.topk_indices_buffer = topk_indices_buffer\n",
        "",
    ),
}
HALVES = {name: half for name, half in HALVES.items() if half[0] in EDITS}


@pytest.mark.parametrize("half", HALVES)
def test_new_test_fails_on_the_bug_with_half_the_fix_removed(released, tmp_path, half):
    """Not by a TypeError: the tree keeps the change's API and loses its effect."""
    tree = patched_tree(released, tmp_path, link=True)
    path, written, instead = HALVES[half]
    text = (tree / path).read_text()
    assert text.count(written) == 1
    (tree / path).write_text(text.replace(written, instead))
    result = run_new_test(tree)
    out = result.stdout
    assert re.search(r"\b\d+ failed", out) and "AssertionError" in out, out[-3000:]
    assert not re.search(r"\b(Type|Attribute|Key|Index)Error\b", out), out[-3000:]
    # A test of the part of the change the half belongs to.
    part = CHANGE.parts[upstream.part_of(path)]
    assert outcomes(out).get("FAILED", set()) & set(sum(part.tests.values(), [])), out[-3000:]


@pytest.mark.skipif(len(CHANGE.parts) < 2 if CHANGE else True, reason="one part")
def test_the_core_applies_alone_and_the_next_part_on_top_of_it(released, tmp_path, capsys):
    """`--core-only` writes the core's files and its tests pass there; a later run adds the
    Mistral Large 4 part alone, to the tree one run makes."""
    core, mistral = CHANGE.parts.values()
    tree = small_tree(released, tmp_path / "tree", link=True)
    before = snapshot(tree)
    assert main(["upstream-patch", "--core-only", str(tree)]) == 0
    after = snapshot(tree)
    assert {p for p in after if after[p] != before.get(p)} == set(core.files)
    result = run_new_test(tree)
    core_tests = set(sum(core.tests.values(), []))
    assert outcomes(result.stdout) == {"PASSED": core_tests}, result.stdout[-3000:]

    capsys.readouterr()
    assert main(["upstream-patch", str(tree)]) == 0
    assert set(re.findall(r"^diff --git a/(\S+)", capsys.readouterr().out, re.M)) == set(
        mistral.files
    )
    assert snapshot(tree) == snapshot(patched_tree(released, tmp_path / "whole", link=True))


def hisparse_refusals(text: str) -> list[str]:
    """The messages of the errors `text`'s code raises about HiSparse."""
    return [
        node.exc.args[0].value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and node.exc.args
        and isinstance(node.exc.args[0], ast.Constant)
        and "HiSparse" in str(node.exc.args[0].value)
    ]


def test_the_tree_refuses_hisparse_under_dbo_for_the_plugins_reason(released, tmp_path):
    """Both refuse HiSparse groups with followers under DBO, for the same reason and with the
    same way out; the tree in vLLM's words (its raise at startup runs in the change's tests)."""
    tree = patched_tree(released, tmp_path)
    [plugin] = hisparse_refusals(Path(patches.__file__).with_name("index_group.py").read_text())
    [in_tree] = hisparse_refusals((tree / INDEX_GROUP).read_text())
    reason = (
        "dual batch overlap on a model with shared top-k layers (index_topk_freq > 1 or an "
        "index_topk_pattern): its top-k staging has no microbatch dimension"
    )
    assert reason in plugin and reason in in_tree, (plugin, in_tree)
    assert "--enable-dbo" in in_tree and "attention_config.hisparse_config" in in_tree


def mypy_groups(root: Path, files: list[str]) -> dict[str, list[str]]:
    """`files` grouped as vLLM's mypy hook groups them (its tools/pre_commit/mypy.py), one
    mypy call each: the default group follows imports, the others skip them."""
    spec = importlib.util.spec_from_file_location("mypy_hook", root / "tools/pre_commit/mypy.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return {group: found for group, found in hook.group_files(files).items() if found}


def mypy_errors(root: Path) -> set[str]:
    """mypy's errors in the touched files `root` has, as vLLM's hook runs it, without line
    numbers.

    Every tree here is vLLM's sdist, differing at most in the touched files: what mypy
    says of a tree is kept under those files' text, mypy's version and what it reads
    besides (the sdist, the installed torch and vLLM), so that no tree is checked twice.
    """
    # One cache per group for every tree and run: a warm one takes seconds, a cold one minutes.
    cache = vllm_sdist.CACHE / "mypy"
    files = [path for path in EDITS if (root / path).is_file()]
    inputs = [vllm_sdist.sha256(vllm_sdist.fetch())]
    inputs += [f"{name} {version(name)}" for name in ("mypy", "torch", "vllm")]
    inputs += [(path, (root / path).read_text()) for path in files]
    known = cache / "errors" / f"{hashlib.sha256(json.dumps(inputs).encode()).hexdigest()}.json"
    if known.is_file():
        return set(json.loads(known.read_text()))
    errors = set()
    for group, found in mypy_groups(root, files).items():
        command = [sys.executable, "-m", "mypy", "--python-version", "3.11"]
        command += ["--cache-dir", str(cache / (group.replace("/", "-") or "default"))]
        command += ["--follow-imports", "skip"] if group else []
        result = subprocess.run(command + found, cwd=root, capture_output=True, text=True)
        assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
        errors |= {
            re.sub(r":\d+: ", ": ", x) for x in result.stdout.splitlines() if ": error: " in x
        }
    known.parent.mkdir(parents=True, exist_ok=True)
    partial = known.with_suffix(f".{os.getpid()}")
    partial.write_text(json.dumps(sorted(errors)))
    partial.replace(known)
    return errors


def test_patched_tree_passes_vllms_hooks_and_adds_no_mypy_error(released, tmp_path):
    """ruff with the tree's settings, vLLM's local hooks for Python files, and mypy
    against the pristine tree (over the touched files, as vLLM's hook scopes it)."""
    # ruff tells vLLM's imports from others by the files they resolve to: the whole sources.
    pristine = upstream_tree.extract_files(
        vllm_sdist.fetch(), tmp_path / "pristine", ("vllm/", "tests/", *HOOK_INPUTS)
    )
    tree = tmp_path / "patched"
    shutil.copytree(pristine, tree)
    assert main(["upstream-patch", str(tree)]) == 0
    ruff = [sys.executable, "-m", "ruff"]
    for command in ([*ruff, "check"], [*ruff, "format", "--check"]):
        result = subprocess.run([*command, *EDITS], cwd=tree, capture_output=True)
        assert result.returncode == 0, result.stdout.decode()
    for hook in LOCAL_HOOKS:
        result = subprocess.run(
            [sys.executable, f"tools/pre_commit/{hook}.py", *EDITS],
            cwd=tree,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, (hook, result.stdout[-3000:])
    assert mypy_errors(tree) - mypy_errors(pristine) == set()


IN_TREE = """
import json
import torch
import vllm_dsa_dbo
from vllm_dsa_dbo import patches
from vllm_dsa_dbo.diagnostics.refusals import left_shared
from vllm_dsa_dbo import cpu_dbo

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


def test_plugin_in_a_patched_tree_retires_only_what_the_tree_carries(released, tmp_path):
    """In a tree made by upstream-patch, the plugin retires the three patches the tree
    carries, keeps its load-time check, and applies the patches of the paths the tree leaves
    out on top of the tree's state; a builder given no count (as deepseek_v2.py builds it,
    before the mla patch hands it one) is refused."""
    tree = patched_tree(released, tmp_path, link=True)
    env = {k: v for k, v in upstream_tree.tree_env(tree).items() if not k.startswith("VLLM_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return fresh.python(list(args), env, cwd=tree)

    result = run("-c", IN_TREE)
    line = next((x for x in result.stdout.splitlines() if x.startswith("TREE ")), None)
    assert line is not None, result.stderr[-3000:]
    found = json.loads(line.removeprefix("TREE "))
    carried = ["deepseek_v32_attention", "index_group", "sparse_mla_attention"]
    assert found["carried"] == carried
    assert found["unapplied"] == []
    assert found["load_check"] == ["base_loader"]
    assert found["refused"] == {"None": True, "2": False}

    status = run("-m", "vllm_dsa_dbo.cli", "status")
    out = status.stdout
    assert status.returncode == 0, out + status.stderr[-3000:]
    # The Mistral Large 4 files the 0.34.0 change holds retire the plugin's Mistral patches too.
    mistral = ["mistral_indexer", "mistral_attention"] if patches.matters(MISTRAL_PATCH) else []
    assert out.count("CARRIED by this vLLM, so not applied") == 3 + len(mistral)
    assert "SparseMLAIndexGroup keeps its top-k state per microbatch" in out
    retired = ["index_group", "sparse_mla_attention", "deepseek_v32_attention"]
    assert f"this vLLM carries {', '.join(retired + mistral)};" in out, out
    applies = out.partition("; the plugin applies ")[2].splitlines()[0].split(", ")
    assert {"mla", "sparse_attn_indexer", "base_loader", "tensorizer"} <= set(applies), out
    assert {"hy_v4_attention", "hy_v4_model", "deepseek_v41_model"} <= set(applies), out
    assert "LEFT UNAPPLIED" not in out, out


# The edits the CPU tests cannot reach, as the patched files hold them: per file, each text
# and how often. They run in models that need a GPU to build (DeepseekV32Model;
# MistralLarge4Model, vLLM 0.34.0).
WRITTEN = {
    "vllm/models/deepseek_v32/nvidia/model.py": {
        "            get_num_ubatches(vllm_config.parallel_config),\n": 1,
    },
    "vllm/models/mistral/mistral_large4/nvidia/model.py": {
        "                get_num_ubatches(vllm_config.parallel_config),\n": 1,
    },
}


def test_models_pass_the_microbatch_count(released, tmp_path):
    """The models build their index groups for the run's microbatches."""
    tree = patched_tree(released, tmp_path)
    for path in set(WRITTEN) & set(EDITS):
        text = (tree / path).read_text()
        assert {x: text.count(x) for x in WRITTEN[path]} == WRITTEN[path], path


def test_patching_a_tree_needs_no_vllm_installed(released, tmp_path):
    """Beside no vLLM, the tree alone: the same files as patched here."""
    exe = bare_python.python(tmp_path / "env")
    tree = small_tree(released, tmp_path / "there")
    result = bare_python.run(exe, "upstream-patch", str(tree))
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1] == f"patched {len(EDITS)} files in {tree}"
    assert snapshot(tree) == snapshot(patched_tree(released, tmp_path / "here"))


def test_diff_applies_with_git_and_dry_run_writes_nothing(released, tmp_path, capsys):
    tree = small_tree(released, tmp_path / "tree")
    before = snapshot(tree)
    assert main(["upstream-patch", "--dry-run", str(tree)]) == 0
    diff = capsys.readouterr().out
    assert snapshot(tree) == before
    assert diff.count("diff --git a/") == len(EDITS)
    (tmp_path / "fix.diff").write_text(diff)
    # Outside a repository `git apply` works as `patch` does, on the files under cwd.
    subprocess.run(["git", "apply", "--check", str(tmp_path / "fix.diff")], cwd=tree, check=True)
    out = tmp_path / "copy"
    assert main(["upstream-patch", "--out", str(out), str(tree)]) == 0
    assert snapshot(tree) == before
    assert snapshot(out) == {
        **before,
        **{
            p: hashlib.sha256(new.encode()).hexdigest()
            for p, (_, new) in upstream.plan(tree).items()
        },
    }


def edit(path: str, old: str, new: str):
    """A tree edit: `old`, found once in `path`, replaced by `new`."""

    def apply(tree: Path) -> None:
        text = (tree / path).read_text()
        assert text.count(old) == 1, old
        (tree / path).write_text(text.replace(old, new))

    return apply


def assign_buffer_before_super_init(tree: Path) -> None:
    """DeepseekV32Attention.__init__ sets its buffer before MLAAttention's __init__."""
    file = tree / DSV32_ATTENTION
    lines = file.read_text().splitlines(keepends=True)
    assign = max(
        i
        for i, line in enumerate(lines)
        if line == "        self.topk_indices_buffer = topk_indices_buffer\n"
    )
    moved = lines.pop(assign)
    lines.insert(lines.index("        super().__init__(\n"), moved)
    file.write_text("".join(lines))


def write_bytes(path: str, data: bytes):
    return lambda tree: (tree / path).write_bytes(data)


def conflict_markers(tree: Path) -> None:
    file = tree / INDEX_GROUP
    file.write_text("<<<<<<< HEAD\n" + file.read_text() + "=======\n>>>>>>> other\n")


# A tree the change does not fit: (how it differs, where the refusal points, why).
MISFITS = {
    "changed context line": (
        edit(
            INDEX_GROUP,
            "        self.num_layers += 1\n",
            "        self.num_layers = self.num_layers + 1\n",
        ),
        f"{INDEX_GROUP}: SparseMLAIndexGroup: differs from vLLM {VERSION}'s",
    ),
    "builder method renamed": (
        edit(
            INDEX_GROUP,
            "    def register_layer(\n        self,\n        is_index",
            "    def add(\n        self,\n        is_index",
        ),
        f"{INDEX_GROUP}: SparseMLAIndexGroupBuilder: differs from vLLM {VERSION}'s",
    ),
    "another version": (
        edit("PKG-INFO", f"\nVersion: {VERSION}\n", "\nVersion: 0.32.0\n"),
        f"PKG-INFO: Version: is 0.32.0, the change is for {' or '.join(upstream.RELEASES)}",
    ),
    "buffer assigned before super().__init__()": (
        assign_buffer_before_super_init,
        f"{DSV32_ATTENTION}: DeepseekV32Attention: differs from vLLM {VERSION}'s",
    ),
    "empty file": (
        write_bytes(INDEX_GROUP, b""),
        f"{INDEX_GROUP}: file: holds no statement (empty or comments only)",
    ),
    "comments only": (
        write_bytes(INDEX_GROUP, b"# SPDX-License-Identifier: Apache-2.0\n\n# gone\n"),
        f"{INDEX_GROUP}: file: holds no statement (empty or comments only)",
    ),
    "class missing": (
        edit(SPARSE_MLA, "class SharedTopkIndicesBuffer:", "class TopkBuffer:"),
        f"{SPARSE_MLA}: SharedTopkIndicesBuffer: found 0 times, expected once",
    ),
    "not UTF-8": (write_bytes(INDEX_GROUP, b"x = '\xff'\n"), f"{INDEX_GROUP}: byte 5: not UTF-8"),
    "conflict markers": (conflict_markers, f"{INDEX_GROUP}: line 1: does not parse"),
    "syntax error": (write_bytes(INDEX_GROUP, b"def f(:\n    pass\n"), "line 1: does not parse"),
    "null byte": (
        write_bytes(INDEX_GROUP, b"x = 1\0\n"),
        f"{INDEX_GROUP}: file: does not parse: source code string cannot contain null bytes",
    ),
    "file missing": (lambda tree: (tree / DSV32_ATTENTION).unlink(), "missing in this tree"),
}
# The test files the change adds (vLLM 0.34.0's Mistral test): there already, or no folder.
for _path in ADDED:
    MISFITS[f"{_path} there already"] = (
        write_bytes(_path, b"def test_other():\n    pass\n"),
        f"{_path}: file: differs from vLLM {VERSION}'s",
    )
    MISFITS[f"{_path}'s folder missing"] = (
        lambda tree, path=_path: shutil.rmtree((tree / path).parent),
        f"{_path}: folder: missing in this tree",
    )


@pytest.mark.parametrize("misfit", MISFITS)
def test_tree_the_change_does_not_fit_is_refused_and_nothing_written(
    released, tmp_path, capsys, misfit
):
    change, refusal = MISFITS[misfit]
    tree = small_tree(released, tmp_path)
    change(tree)
    before = snapshot(tree)
    assert main(["upstream-patch", str(tree)]) == 2
    err = capsys.readouterr().err
    assert refusal in err and err.rstrip().endswith("nothing written"), err
    assert len(err.splitlines()) == 1, err
    assert snapshot(tree) == before


def test_already_patched_tree_is_refused_and_nothing_written(released, tmp_path, capsys):
    tree = patched_tree(released, tmp_path / "tree")
    capsys.readouterr()
    before = snapshot(tree)
    assert main(["upstream-patch", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "already changed: the tree carries the fix" in err and "nothing written" in err
    assert snapshot(tree) == before
    # Each file alone: a tree patched in part is refused too.
    for path in EDITS:
        partial = small_tree(released, tmp_path / path.replace("/", "_"))
        shutil.copyfile(tree / path, partial / path)
        with pytest.raises(upstream.PatchRefused, match="carries the fix"):
            upstream.plan(partial)


@pytest.mark.parametrize("what", ["not a directory", "no vllm", "--out exists"])
def test_bad_source_is_an_error(released, tmp_path, capsys, what):
    tree = small_tree(released, tmp_path / "tree")
    args = ["upstream-patch", str(tree)]
    if what == "not a directory":
        args = ["upstream-patch", str(tmp_path / "nowhere")]
    elif what == "no vllm":
        args = ["upstream-patch", str(tmp_path)]
    else:
        args += ["--out", str(tmp_path)]
    before = snapshot(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert snapshot(tmp_path) == before


def test_out_that_cannot_be_written_is_an_error(released, tmp_path):
    tree = small_tree(released, tmp_path / "tree")
    (tmp_path / "file").write_text("")
    result = cli("upstream-patch", "--out", str(tmp_path / "file" / "copy"), str(tree))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"error: cannot write the patched tree to {tmp_path / 'file' / 'copy'}: "
    )


def test_released_tree_patched_runs_vllms_sparse_mla_tests_unchanged(tmp_path):
    """The whole sdist patched: vLLM's tests of the files the change edits that need no GPU
    (the CPU copy of its sparse MLA tests) give the same outcomes as in the released tree. With
    the change's fields given no class-level default, vLLM's HiSparse tests there fail, as they
    did on a GPU."""
    try:
        tree = upstream_tree.extract_tree(vllm_sdist.fetch(), tmp_path)
    except vllm_sdist.SdistUnavailable as e:
        pytest.skip(f"vLLM's sdist not available: {e}")
    # The released sources are the installed vLLM's: the released tree's tests run against it,
    # forked from a process that imported it.
    assert upstream_tree.sources_differing_from_installed(tree) == []
    _, before = vllm_sdist.run(tree, vllm_sdist.sparse_mla_tests_on_cpu(tree), "stock")
    assert upstream_tree.patch_tree(tree).returncode == 0
    assert upstream_tree.sources_differing_from_installed(tree) == sorted(
        p for p in EDITS if p.startswith("vllm/")
    )
    assert upstream_tree.imports_from(tree) == str(tree / "vllm" / "__init__.py")

    summary, after = upstream_tree.run(tree, vllm_sdist.sparse_mla_tests_on_cpu(tree))
    # The change's own tests there (its HiSparse refusal) pass; every other outcome is kept.
    new = {t for t in after if t.rsplit("::", 1)[1].split("[")[0] in NEW_TESTS}
    assert new and {after.pop(t) for t in new} == {"passed"}, summary
    assert after and set(after.values()) <= {"passed", "skipped"}, summary
    assert after == before and "passed" in after.values(), summary

    text = (tree / INDEX_GROUP).read_text()
    (tree / INDEX_GROUP).write_text(text.replace("] = ()\n", "] = field(default_factory=list)\n"))
    summary, mutated = upstream_tree.run(tree, vllm_sdist.sparse_mla_tests_on_cpu(tree))
    failed = {t.rsplit("::", 1)[1] for t, outcome in mutated.items() if outcome == "failure"}
    assert failed == vllm_sdist.BARE_HISPARSE_TESTS, summary


@pytest.fixture(scope="module")
def release_sources() -> Path:
    """The whole released sdist, extracted once into the cache: never written here."""
    try:
        return vllm_sdist.sources(vllm_sdist.fetch())
    except vllm_sdist.SdistUnavailable as e:
        pytest.skip(f"vLLM's sdist not available: {e}")


def link_tree(source: Path, dest: Path) -> Path:
    """`source`'s `vllm/` and `tests/` as links to its files (upstream-patch replaces the
    links of the files it writes), and a copy of its PKG-INFO."""
    for folder in regenerate.FOLDERS:
        for parent, _, files in os.walk(source / folder):
            mirror = dest / Path(parent).relative_to(source)
            mirror.mkdir(parents=True, exist_ok=True)
            for name in files:
                (mirror / name).symlink_to(Path(parent, name))
    shutil.copyfile(source / "PKG-INFO", dest / "PKG-INFO")
    return dest


def rewrite(root: Path, path: str, old: str, new: str) -> None:
    """`old`, found once in `path`, replaced by `new` in a file of its own (not the link's)."""
    text = (root / path).read_text()
    assert text.count(old) == 1, old
    (root / path).unlink()
    (root / path).write_text(text.replace(old, new))


def data_module(root: Path) -> Path:
    return root / f"change_{VERSION.replace('.', '_')}.py"


def test_data_is_what_regenerate_writes_from_the_patched_release(release_sources, tmp_path):
    """The committed data for this release, byte for byte, from its sdist and the tree
    upstream-patch makes of it."""
    tree = link_tree(release_sources, tmp_path / "tree")
    assert main(["upstream-patch", str(tree)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    assert regenerate.main([str(release_sources), str(tree), "--out", str(out)]) == 0
    assert os.listdir(out) == [data_module(out).name]
    assert data_module(out).read_text() == data_module(Path(upstream.__file__).parent).read_text()


# A pair of trees regenerate refuses: (what differs, in which tree, the refusal).
REGENERATE_MISFITS = {
    "another version": (
        "tree",
        lambda root: rewrite(root, "PKG-INFO", f"\nVersion: {VERSION}\n", "\nVersion: 0.32.0\n"),
        f"PKG-INFO: Version: is 0.32.0, the release given is {VERSION}",
    ),
    "release statement changed": (
        "release",
        lambda root: rewrite(
            root, INDEX_GROUP, "        self.num_layers += 1\n", "        self.num_layers += 2\n"
        ),
        f"{INDEX_GROUP}: SparseMLAIndexGroup: differs from vLLM {VERSION}'s recorded one",
    ),
    "statement renamed": (
        "tree",
        lambda root: rewrite(
            root, INDEX_GROUP, "class SparseMLAIndexGroupBuilder:", "class IndexGroupBuilder:"
        ),
        f"{INDEX_GROUP}: SparseMLAIndexGroupBuilder: found 0 times in the patched tree",
    ),
    "edited file empty": (
        "tree",
        lambda root: rewrite(root, INDEX_GROUP, (root / INDEX_GROUP).read_text(), ""),
        f"{INDEX_GROUP}: file: holds no statement (empty or comments only)",
    ),
    "edited file comments only": (
        "tree",
        lambda root: rewrite(root, INDEX_GROUP, (root / INDEX_GROUP).read_text(), "# gone\n"),
        f"{INDEX_GROUP}: file: holds no statement (empty or comments only)",
    ),
    "edited file gone": (
        "tree",
        lambda root: (root / DSV32_ATTENTION).unlink(),
        f"{DSV32_ATTENTION}: file: missing in the patched tree",
    ),
}


@pytest.mark.parametrize("misfit", REGENERATE_MISFITS)
def test_regenerate_refuses_a_tree_it_cannot_key_and_writes_nothing(
    release_sources, tmp_path, capsys, misfit
):
    which, change, refusal = REGENERATE_MISFITS[misfit]
    trees = {"release": link_tree(release_sources, tmp_path / "release")}
    trees["tree"] = link_tree(release_sources, tmp_path / "tree")
    assert main(["upstream-patch", str(trees["tree"])]) == 0
    change(trees[which])
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    assert regenerate.main([str(trees["release"]), str(trees["tree"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert refusal in err and err.rstrip().endswith("nothing written"), err
    assert len(err.splitlines()) == 1, err
    assert os.listdir(out) == []
