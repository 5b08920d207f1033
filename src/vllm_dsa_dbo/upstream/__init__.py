"""`vllm-dsa-dbo upstream-patch`: the fix as a change to a released vLLM source tree.

Each release's change is data, one module per release (`change_<release>.py`, written by
`python -m vllm_dsa_dbo.upstream.regenerate` from a patched tree): per vLLM file, each
top-level statement it edits (named as `statement_name` names it, "" for a file the change
adds), the sha256 of that statement's text in the release and in a tree that carries the
change (which tells a second run apart), and its edits, each an `@@ first last` line and the
lines that replace lines [first, last) of the statement. A tree where a statement differs is
refused, as `git apply --check` refuses changed context, and nothing is written. Only the
lines the change writes are kept here.

A release's change comes in parts (`PARTS`), each applying on top of those before it: the core
(the upstream PR's scope: GLM-5, DeepSeek-V3.2), then Mistral Large 4 (vLLM 0.34.0). A tree
that carries the first parts whole takes the next ones alone.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib
import os
import pkgutil
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

# One edit of a statement: its `@@ first last` line, then the lines it writes.
EDIT = re.compile(r"^@@ (\d+) (\d+)\n(.*?)(?=^@@ |\Z)", re.M | re.S)
# What a statement of a file the change adds hashes to in a tree without it.
ABSENT = hashlib.sha256(b"").hexdigest()
NEW_FILE = ""

# Per file, per statement: (its sha256 in the release, in a tree with the change, the edits).
Statements = Mapping[str, Mapping[str, tuple[str, str, str]]]
# The parts of a change, in the order they apply: (name, the folders of its files); the first
# takes every file no other part names.
PARTS = (
    ("core", ()),
    ("mistral-large-4", ("vllm/models/mistral/", "tests/models/mistral/")),
)


def part_of(path: str) -> str:
    """The name of the part a changed file belongs to."""
    return next((name for name, folders in PARTS[1:] if path.startswith(folders)), PARTS[0][0])


@dataclass(frozen=True)
class Change:
    """One release's change."""

    version: str
    files: Statements

    @property
    def edits(self) -> tuple[str, ...]:
        """The files it touches, tests included."""
        return tuple(self.files)

    @property
    def parts(self) -> dict[str, Change]:
        """Its parts that have files, by name, in the order they apply."""
        found = {
            name: Change(self.version, {p: s for p, s in self.files.items() if part_of(p) == name})
            for name, _ in PARTS
        }
        return {name: part for name, part in found.items() if part.files}

    @property
    def tests(self) -> dict[str, list[str]]:
        """The test functions its lines define, per file."""
        found: dict[str, list[str]] = {}
        for path, statements in self.files.items():
            for _, _, edits in statements.values():
                for name in re.findall(r"^def (test_\w+)\(", edits, re.M):
                    found.setdefault(path, []).append(name)
        return found


def _releases() -> dict[str, Change]:
    """The change of each release this package has data for, oldest first."""
    found = []
    for module in pkgutil.iter_modules(__path__, f"{__name__}."):
        if module.name.rpartition(".")[2].startswith("change_"):
            data = importlib.import_module(module.name)
            found.append(Change(data.VERSION, data.CHANGE))
    return {c.version: c for c in sorted(found, key=lambda c: Version(c.version))}


RELEASES = _releases()


class PatchRefused(Exception):
    """The change does not fit this tree: nothing was written."""

    def __init__(self, path: str, place: str, why: str) -> None:
        super().__init__(f"{path}: {place}: {why}")


def statement_name(node: ast.stmt) -> str:
    """How the data names a top-level statement: a def's or class's name, an
    import's module, else the statement's first line."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name
    if isinstance(node, ast.ImportFrom):
        return f"from {'.' * node.level}{node.module} import"
    return ast.unparse(node).splitlines()[0]


def spans(text: str) -> dict[str, list[tuple[int, int]]]:
    """Each top-level statement's name and its lines, from its first (decorators
    included) to the next statement's first; none for a file of comments only."""
    body = ast.parse(text).body
    starts = [
        min([n.lineno, *(d.lineno for d in getattr(n, "decorator_list", []))]) - 1 for n in body
    ]
    ends = [*starts[1:], len(text.splitlines())][: len(body)]
    found: dict[str, list[tuple[int, int]]] = {}
    for node, first, last in zip(body, starts, ends, strict=True):
        found.setdefault(statement_name(node), []).append((first, last))
    return found


def defined(text: str) -> Counter[str]:
    """The functions and classes a file defines at its top level, by name."""
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return Counter(n.name for n in ast.parse(text).body if isinstance(n, kinds))


def parse(path: str, text: str) -> dict[str, list[tuple[int, int]]]:
    """`spans` of a file, or why it cannot carry an edit."""
    try:
        found = spans(text)
    except SyntaxError as e:
        where = f"line {e.lineno}" if e.lineno else "file"
        raise PatchRefused(path, where, f"does not parse: {e.msg}") from None
    if not found:
        raise PatchRefused(path, "file", "holds no statement (empty or comments only)")
    return found


def read(root: Path, path: str, new: bool = False) -> str:
    """A file's text; "" for a file the change adds that the tree lacks."""
    file = root / path
    if new and not file.exists():
        if not file.parent.is_dir():
            raise PatchRefused(path, "folder", "missing in this tree")
        return ""
    if not file.is_file():
        raise PatchRefused(path, "file", "missing in this tree")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PatchRefused(path, f"byte {e.start}", "not UTF-8 text") from None
    except OSError as e:
        raise PatchRefused(path, "file", f"cannot be read: {e.strerror}") from None


def sdist_version(root: Path) -> str | None:
    """An sdist's PKG-INFO names its version; a git checkout has none to read."""
    info = root / "PKG-INFO"
    if not info.is_file():
        return None
    lines = info.read_text(encoding="utf-8", errors="replace").splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("Version:")), "")


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def statement_digests(root: Path, path: str, names: Iterable[str]) -> dict[str, list[str]] | None:
    """The sha256 of each top-level statement named in `names` in `root`'s file at `path`, per
    name (one per place it occurs); None where the file cannot be read or parsed."""
    try:
        lines = read(root, path).splitlines(keepends=True)
        found = spans("".join(lines))
    except (PatchRefused, SyntaxError):
        return None
    return {n: [digest("".join(lines[a:b])) for a, b in found.get(n, [])] for n in names}


def fitting(root: Path, change: Change) -> int:
    """How many of the statements `change` edits are in `root` as in its release, or as
    it leaves them."""
    count = 0
    for path, statements in change.files.items():
        found = statement_digests(root, path, statements) or {}
        for name, (original, changed, _) in statements.items():
            count += sum(d in (original, changed) for d in found.get(name, []))
    return count


def release(root: Path) -> Change:
    """The change for the sdist's version; for a git checkout, the one its statements fit."""
    version = sdist_version(root)
    if version is not None and version not in RELEASES:
        known = " or ".join(RELEASES)
        raise PatchRefused("PKG-INFO", "Version", f"is {version}, the change is for {known}")
    candidates = [RELEASES[version]] if version in RELEASES else list(RELEASES.values())
    return max(reversed(candidates), key=lambda change: fitting(root, change))


def patched(path: str, text: str, change: Change) -> str:
    """`text` with the change's edits, each statement checked against its release's."""
    statements = change.files[path]
    added = NEW_FILE in statements
    found = {NEW_FILE: [(0, len(text.splitlines()))]} if added else parse(path, text)
    lines = text.splitlines(keepends=True)
    edits, differ = [], []
    for name, (original, changed, statement_edits) in statements.items():
        where = found.get(name, [])
        if len(where) != 1:
            raise PatchRefused(path, name, f"found {len(where)} times, expected once")
        first, last = where[0]
        now = digest("".join(lines[first:last]))
        if now == changed != original:
            raise PatchRefused(path, name or "file", "already changed: the tree carries the fix")
        if now != original:
            differ.append(name or "file")
        edits += [
            (first + int(start), first + int(end), new)
            for start, end, new in EDIT.findall(statement_edits)
        ]
    if differ:
        raise PatchRefused(path, differ[0], f"differs from vLLM {change.version}'s")
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    # A function or class the change adds beside a statement leaves that statement as is.
    before, after = defined(text), defined("".join(lines))
    twice = next((name for name in after if after[name] > before[name] > 0), None)
    if twice is not None:
        raise PatchRefused(path, twice, "already changed: the tree carries the fix")
    return "".join(lines)


def carries(root: Path, change: Change) -> bool:
    """Whether `root` holds every statement `change` edits as it leaves it."""
    for path, statements in change.files.items():
        if NEW_FILE in statements:
            try:
                found = {NEW_FILE: [digest(read(root, path))]}
            except PatchRefused:
                return False
        else:
            found = statement_digests(root, path, statements) or {}
        if any(found.get(name) != [changed] for name, (_, changed, _) in statements.items()):
            return False
    return True


def plan(root: Path, first_only: bool = False) -> dict[str, tuple[str, str]]:
    """Each file the change touches under `root`: (its text, "" for a file it adds; the
    patched text). The parts the tree carries whole, before the first it lacks, are left as
    they are; with `first_only`, the parts after the first are left out."""
    if not (root / "vllm").is_dir():
        raise PatchRefused(str(root), "vllm/", "no vLLM source tree here (give its root)")
    parts = list(release(root).parts.values())[: 1 if first_only else None]
    while parts[1:] and carries(root, parts[0]):
        parts.pop(0)
    changes = {}
    for part in parts:
        for path, statements in part.files.items():
            text = read(root, path, new=NEW_FILE in statements)
            changes[path] = (text, patched(path, text, part))
    return changes


def unified_diff(changes: dict[str, tuple[str, str]]) -> Iterator[str]:
    """`git diff`-style text of `changes`."""
    for path, (old, new) in changes.items():
        yield f"diff --git a/{path} b/{path}\n"
        if not old:
            yield "new file mode 100644\n"
        yield from difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"a/{path}" if old else "/dev/null",
            f"b/{path}",
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
            if target.exists():
                shutil.copymode(target, tmp)
            else:
                os.chmod(tmp, 0o644)
            staged.append((tmp, target))
    except BaseException:
        for tmp, _ in staged:
            os.unlink(tmp)
        raise
    for tmp, target in staged:
        os.replace(tmp, target)
