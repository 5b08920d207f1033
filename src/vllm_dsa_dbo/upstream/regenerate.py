"""The change's data for one vLLM release, from that release and a tree carrying the change.

    python -m vllm_dsa_dbo.upstream.regenerate RELEASE PATCHED [--out DIR]

RELEASE is the release's unpacked sdist (its PKG-INFO names the version); PATCHED is that
release's tree with the change made in it, by `vllm-dsa-dbo upstream-patch` and then by hand,
and nothing else: every Python file under its `vllm/` and `tests/` that differs from
RELEASE's is the change. Writes `change_<version>.py` into DIR (this package by default):
per edited top-level statement, the sha256 of its text in both trees and the lines the change
writes, no other vLLM text. A tree of another version, a statement that differs from the
release's recorded one, an edit that no statement can key, or a file the edits cannot
reproduce is refused with exit 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import difflib
import filecmp
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vllm_dsa_dbo.upstream import (
    ABSENT,
    NEW_FILE,
    RELEASES,
    Change,
    PatchRefused,
    Statements,
    digest,
    parse,
    patched,
    read,
    sdist_version,
)

# Where the change's files are: vLLM's sources and its tests.
FOLDERS = ("vllm", "tests")


def python_files(root: Path) -> Iterator[str]:
    """The Python files under `root`'s FOLDERS (linked folders left out), as paths from
    `root`."""
    for folder in FOLDERS:
        for parent, dirs, files in os.walk(root / folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    yield str(Path(parent, name).relative_to(root))


def changed_files(release: Path, tree: Path) -> list[str]:
    """The Python files `tree` changes or adds; a file it lacks is refused."""
    ours, theirs = set(python_files(tree)), set(python_files(release))
    missing = sorted(theirs - ours)
    if missing:
        raise PatchRefused(
            missing[0], "file", "missing in the patched tree (a change adds or edits)"
        )
    return sorted(
        path
        for path in ours
        if path not in theirs
        or not os.path.samefile(release / path, tree / path)
        and not filecmp.cmp(release / path, tree / path, shallow=False)
    )


def owners(order: list[tuple[int, int, str]], i1: int, i2: int) -> list[tuple[int, int, str]]:
    """The statements an edit of lines [i1, i2) falls in; an insertion's is the one it
    starts, or at the file's end the last."""
    if i1 == i2:
        return [s for s in order if s[0] <= i1 < s[1] or i1 == s[1] == order[-1][1]][:1]
    return [s for s in order if s[0] < i2 and i1 < s[1]]


def statements(path: str, old: str | None, new: str) -> dict[str, tuple[str, str, str]]:
    """The change to one file (`old` None: one it adds): per top-level statement of `old` it
    edits, its sha256 in `old` and `new` and its edits, in the file's order."""
    after = parse(path, new)
    if old is None:
        return {NEW_FILE: (ABSENT, digest(new), f"@@ 0 0\n{new}")}
    before = parse(path, old)
    order = sorted((first, last, name) for name, where in before.items() for first, last in where)
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    edits: dict[str, list[str]] = {}
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        text = "".join(new_lines[j1:j2])
        if text and not text.endswith("\n"):
            raise PatchRefused(path, f"line {j2}", "the change ends without a newline")
        edited = owners(order, i1, i2)
        if not edited or i1 < order[0][0]:
            raise PatchRefused(path, f"line {i1 + 1}", "edited outside any statement")
        for k, (first, last, name) in enumerate(edited):
            start, end = max(i1, first), min(i2, last)
            edits.setdefault(name, []).append(f"@@ {start - first} {end - first}\n")
            edits[name].append(text if k == 0 else "")
    found = {}
    for name, lines in edits.items():
        for tree, where in (("release", before), ("patched tree", after)):
            if len(where.get(name, [])) != 1:
                count = len(where.get(name, []))
                raise PatchRefused(path, name, f"found {count} times in the {tree}, expected once")
        (first, last), (now_first, now_last) = before[name][0], after[name][0]
        found[(first, name)] = (
            digest("".join(old_lines[first:last])),
            digest("".join(new_lines[now_first:now_last])),
            "".join(lines),
        )
    return {name: found[(first, name)] for first, name in sorted(found)}


def regenerate(release: Path, tree: Path) -> Change:
    """The change `tree` carries against `release`, checked to reproduce `tree`."""
    version = sdist_version(release)
    if not version:
        raise PatchRefused(str(release), "PKG-INFO", "no version: give the release's sdist")
    if not (tree / "vllm").is_dir():
        raise PatchRefused(str(tree), "vllm/", "no vLLM source tree here (give its root)")
    theirs = sdist_version(tree)
    if theirs is not None and theirs != version:
        raise PatchRefused("PKG-INFO", "Version", f"is {theirs}, the release given is {version}")
    paths = changed_files(release, tree)
    if not paths:
        raise PatchRefused(str(tree), "vllm/", "no change against the release")
    recorded = RELEASES[version].files if version in RELEASES else {}
    # Sources before tests, each in the order of this release's data (else the latest's).
    order = list(recorded or (list(RELEASES.values())[-1].files if RELEASES else {}))
    paths.sort(
        key=lambda p: (p.startswith("tests/"), order.index(p) if p in order else len(order), p)
    )
    files: Statements = {
        path: statements(
            path, read(release, path) if (release / path).exists() else None, read(tree, path)
        )
        for path in paths
    }
    for path, edited in files.items():
        for name, (original, _, _) in edited.items():
            known = recorded.get(path, {}).get(name)
            if known is not None and known[0] != original:
                raise PatchRefused(path, name, f"differs from vLLM {version}'s recorded one")
    change = Change(version, files)
    for path in files:
        if patched(path, read(release, path, new=True), change) != read(tree, path):
            raise PatchRefused(path, "file", "its edits do not reproduce the patched tree")
    return change


def literal(text: str) -> str:
    """`text` as a triple-quoted literal, its lines as they are."""
    quotes = "'''" if '"""' in text else '"""'
    return quotes + "\\\n" + text.replace("\\", "\\\\") + quotes


def render(change: Change) -> str:
    """The data module for `change`, as `ruff format` leaves it."""
    out = [
        f'"""vLLM {change.version}\'s in-tree change, as data (`vllm_dsa_dbo.upstream` reads'
        " it), written\nby `python -m vllm_dsa_dbo.upstream.regenerate` from a patched tree:"
        ' regenerate, do not edit."""\n',
        f'VERSION = "{change.version}"',
        "CHANGE = {",
    ]
    for path, edited in change.files.items():
        out.append(f"    {json.dumps(path)}: {{")
        for name, (original, changed, edits) in edited.items():
            key = json.dumps(name, ensure_ascii=False)
            out += [f"        {key}: (", f'            "{original}",', f'            "{changed}",']
            out += [f"            {literal(edits)},", "        ),"]
        out.append("    },")
    return "\n".join([*out, "}", ""])


def error(message: str) -> int:
    print(f"error: {message}; nothing written", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_dsa_dbo.upstream.regenerate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("release", type=Path, help="the vLLM release's unpacked sdist")
    parser.add_argument("patched", type=Path, help="that release's tree carrying the change")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent, help="where the data module goes"
    )
    args = parser.parse_args(argv)
    try:
        change = regenerate(args.release, args.patched)
    except PatchRefused as e:
        return error(f"cannot regenerate from {args.patched}: {e}")
    target = args.out / f"change_{change.version.replace('.', '_')}.py"
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=args.out, prefix=f".{target.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(render(change))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return error(f"cannot write {target}: {e}")
    print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
