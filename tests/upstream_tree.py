"""vLLM source trees of the installed release, unpatched and through `vllm-dsa-dbo
upstream-patch`, that run.

A tree is the sdist's `vllm/` and `tests/` (its top-level files too, without
`vllm.egg-info`, so the installed vLLM's metadata stays the one found). The
sdist carries vLLM's Python sources only; every file of the installed vLLM
the sdist lacks (compiled extensions, vendored packages, generated modules)
is linked into the tree's `vllm/`. Pytest runs in the tree's root through
`python -c`, which puts that root first on sys.path (PYTHONPATH too, for
subprocesses): `import vllm` then takes every Python file from the tree.

    python tests/upstream_tree.py PYTEST_ARGS   # unpatched, patched: summaries, outcomes

The change's tests exist in the patched tree only; every other outcome must match.

Both trees run at once: on a GPU vLLM's sparse MLA backend tests leave it mostly idle, and
one tree after the other they take longer than one device call may run.

On a CPU vLLM's sparse MLA tests skip themselves; tests/tree_dbo_ubatch.py runs
the change's tests there, and `vllm_sdist.sparse_mla_tests_on_cpu` the others that need no GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import vllm_sdist
from vllm_dsa_dbo.upstream import RELEASES

# The test functions the change adds, by name.
NEW_TESTS = {name for names in RELEASES[vllm_sdist.VERSION].tests.values() for name in names}


def installed_vllm() -> Path:
    """The installed vLLM's package folder, found without importing it."""
    result = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return Path(result.stdout.strip()).parent


def extract_tree(sdist: Path, dest: Path) -> Path:
    """The sdist's sources under `dest`, with the installed vLLM's other files linked in."""
    top = [p.name for p in vllm_sdist.sources(sdist).iterdir() if p.is_file()]
    root = extract_files(sdist, dest, (*vllm_sdist.TREE_FOLDERS, *top))
    link_installed(installed_vllm(), root / "vllm")
    return root


def extract_files(sdist: Path, dest: Path, paths: tuple[str, ...]) -> Path:
    """The sdist's files and folders at `paths` (those it has), copied under `dest`."""
    source = vllm_sdist.sources(sdist)
    root = dest / source.name
    for path in paths:
        if (source / path).is_dir():
            shutil.copytree(source / path, root / path, dirs_exist_ok=True)
        elif (source / path).is_file():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / path, root / path)
    return root


def link_installed(installed: Path, tree: Path) -> None:
    """Link each file or folder of `installed` that `tree` lacks, at the same place."""
    for entry in installed.iterdir():
        if entry.name == "__pycache__":
            continue
        mirror = tree / entry.name
        if not mirror.exists():
            mirror.symlink_to(entry)
        elif entry.is_dir() and not entry.is_symlink():
            link_installed(entry, mirror)


def sources_differing_from_installed(root: Path) -> list[str]:
    """The Python files of the tree's `vllm/` (links aside) that differ from the installed
    vLLM's, as paths from `root`."""
    installed = installed_vllm()
    return sorted(
        str(path.relative_to(root))
        for path in (root / "vllm").rglob("*.py")
        if not path.is_symlink()
        and path.read_bytes() != (installed / path.relative_to(root / "vllm")).read_bytes()
    )


def patch_tree(root: Path) -> subprocess.CompletedProcess:
    """`vllm-dsa-dbo upstream-patch root`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_dsa_dbo.cli", "upstream-patch", str(root)],
        capture_output=True,
        text=True,
    )


def imports_from(root: Path) -> str:
    """Where `import vllm` resolves for a run in `root` (found as the import would, without
    running vLLM's imports)."""
    result = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
        cwd=root,
        env=tree_env(root),
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def tree_env(root: Path) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep + path if path else ''}"}


def run(root: Path, args: list[str]) -> tuple[str, dict[str, str]]:
    """vLLM's tests in `root`, with no plugin loaded: summary line and outcomes."""
    return vllm_sdist.run(root, args, "stock", {"PYTHONPATH": tree_env(root)["PYTHONPATH"]})


def prepare(dest: Path) -> tuple[Path, Path]:
    """An unpatched and a patched tree under `dest`."""
    unpatched = extract_tree(vllm_sdist.fetch(), dest / "unpatched")
    patched = dest / "patched" / unpatched.name
    shutil.copytree(unpatched, patched, symlinks=True)
    result = patch_tree(patched)
    if result.returncode != 0:
        raise RuntimeError(f"upstream-patch failed: {result.stderr}")
    return unpatched, patched


def timed_run(name: str, root: Path, args: list[str]) -> tuple[str, dict[str, str]]:
    start = time.monotonic()
    summary, outcomes = run(root, args)
    # vllm_sdist labels its runs by plugin mode; both trees run without the plugin.
    print(f"{name}: {summary.removeprefix('stock: ')} ({time.monotonic() - start:.0f} s)")
    return summary, outcomes


def main(argv: list[str]) -> int:
    dest = Path(os.environ.get("VLLM_DSA_DBO_TREES", vllm_sdist.CACHE / "trees"))
    shutil.rmtree(dest, ignore_errors=True)
    unpatched, patched = prepare(dest)
    print(f"trees under {dest}; the patched tree imports {imports_from(patched)}")
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(
            lambda t: timed_run(*t, argv), (("unpatched", unpatched), ("patched", patched))
        )
        (_, before), (_, after) = runs
    new = {t for t in after if t.rsplit("::", 1)[-1].split("[")[0] in NEW_TESTS}
    same = before == {t: o for t, o in after.items() if t not in new} and bool(before)
    print("same outcomes, test by test" if same else "OUTCOMES DIFFER (or nothing ran)")
    for test in sorted((set(before) | set(after)) - new):
        if before.get(test) != after.get(test):
            print(f"  {test}: unpatched {before.get(test)}, patched {after.get(test)}")
    fixed = bool(new) and {after[t] for t in new} == {"passed"}
    names = ", ".join(sorted(NEW_TESTS))
    print(f"{names}: pass patched" if fixed else f"{names}: DO NOT PASS patched")
    return 0 if same and fixed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
