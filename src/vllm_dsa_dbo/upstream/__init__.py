"""`vllm-dsa-dbo upstream-patch`: the fix as a change to a vLLM 0.33.0 source tree.

Each edit belongs to one top-level statement of a vLLM file, found by `ast` and
checked against the sha256 of its text in 0.33.0 (`change.CHANGE`): a tree where
one differs is refused, as `git apply --check` refuses changed context, and
nothing is written. Only the lines the change writes are kept here.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vllm_dsa_dbo.upstream.change import CHANGE

VERSION = "0.33.0"
EDITS = tuple(CHANGE)  # the files the change touches, tests included
TEST_FILE = "tests/v1/attention/test_sparse_mla_backends.py"
NEW_TEST = "test_sparse_mla_index_group_keeps_topk_per_dbo_ubatch"
# One edit in `CHANGE`: its `@@ first last` line, then the lines it writes.
EDIT = re.compile(r"^@@ (\d+) (\d+)\n(.*?)(?=^@@ |\Z)", re.M | re.S)


class PatchRefused(Exception):
    """The change does not fit this tree: nothing was written."""

    def __init__(self, path: str, place: str, why: str) -> None:
        super().__init__(f"{path}: {place}: {why}")


def statement_name(node: ast.stmt) -> str:
    """How `CHANGE` names a top-level statement: a def's or class's name, an
    import's module, else the statement's first line."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name
    if isinstance(node, ast.ImportFrom):
        return f"from {'.' * node.level}{node.module} import"
    return ast.unparse(node).splitlines()[0]


def spans(text: str) -> dict[str, list[tuple[int, int]]]:
    """Each top-level statement's name and its lines, from its first (decorators
    included) to the next statement's first."""
    body = ast.parse(text).body
    starts = [
        min([n.lineno, *(d.lineno for d in getattr(n, "decorator_list", []))]) - 1 for n in body
    ]
    ends = [*starts[1:], len(text.splitlines())]
    found: dict[str, list[tuple[int, int]]] = {}
    for node, first, last in zip(body, starts, ends, strict=True):
        found.setdefault(statement_name(node), []).append((first, last))
    return found


def read(root: Path, path: str) -> str:
    file = root / path
    if not file.is_file():
        raise PatchRefused(path, "file", "missing in this tree")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PatchRefused(path, f"byte {e.start}", "not UTF-8 text") from None
    except OSError as e:
        raise PatchRefused(path, "file", f"cannot be read: {e.strerror}") from None


def check_version(root: Path) -> None:
    """An sdist's PKG-INFO names its version; a git checkout has none to read."""
    info = root / "PKG-INFO"
    if not info.is_file():
        return
    lines = info.read_text(encoding="utf-8", errors="replace").splitlines()
    version = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("Version:")), None)
    if version != VERSION:
        raise PatchRefused("PKG-INFO", "Version", f"is {version}, the change is for {VERSION}")


def patched(path: str, text: str) -> str:
    """`text` with the change's edits, each statement checked against 0.33.0's."""
    try:
        found = spans(text)
    except SyntaxError as e:
        where = f"line {e.lineno}" if e.lineno else "file"
        raise PatchRefused(path, where, f"does not parse: {e.msg}") from None
    lines = text.splitlines(keepends=True)
    edits, differ = [], []
    for name, (original, changed, statement_edits) in CHANGE[path].items():
        where = found.get(name, [])
        if len(where) != 1:
            raise PatchRefused(path, name, f"found {len(where)} times, expected once")
        first, last = where[0]
        digest = hashlib.sha256("".join(lines[first:last]).encode()).hexdigest()
        if digest == changed != original:
            raise PatchRefused(path, name, "already changed: the tree carries the fix")
        if digest != original:
            differ.append(name)
        edits += [
            (first + int(start), first + int(end), new)
            for start, end, new in EDIT.findall(statement_edits)
        ]
    if differ:
        raise PatchRefused(path, differ[0], f"differs from vLLM {VERSION}'s")
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    return "".join(lines)


def plan(root: Path) -> dict[str, tuple[str, str]]:
    """Each file the change touches under `root`: (its text, the patched text)."""
    if not (root / "vllm").is_dir():
        raise PatchRefused(str(root), "vllm/", "no vLLM source tree here (give its root)")
    check_version(root)
    changes = {}
    for path in CHANGE:
        text = read(root, path)
        changes[path] = (text, patched(path, text))
    return changes


def unified_diff(changes: dict[str, tuple[str, str]]) -> Iterator[str]:
    """`git diff`-style text of `changes`."""
    for path, (old, new) in changes.items():
        yield f"diff --git a/{path} b/{path}\n"
        yield from difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"
        )


def write(root: Path, changes: dict[str, tuple[str, str]]) -> None:
    """Write every file, or none: all go to temporary files first, then each replaces its own."""
    staged = []
    try:
        for path, (_, new) in changes.items():
            target = root / path
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(new)
            shutil.copymode(target, tmp)
            staged.append((tmp, target))
    except BaseException:
        for tmp, _ in staged:
            os.unlink(tmp)
        raise
    for tmp, target in staged:
        os.replace(tmp, target)
