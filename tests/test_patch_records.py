"""Every patch's `PATCH` record, the isolation checker's included, lists the symbols
of its target that `apply` sets."""

from __future__ import annotations

import json
from pathlib import Path

from test_plugin import run_python
from vllm_dsa_dbo.diagnostics import isolation, load_check
from vllm_dsa_dbo.patches import NAMES, fix_patches, matters

# In a fresh interpreter: each patch applied in order, its target compared before and after.
APPLY_EACH = """
    import importlib, json, types
    from vllm_dsa_dbo import patches
    from vllm_dsa_dbo.diagnostics import isolation, load_check

    def symbols(module):
        found = {}
        for name, value in vars(module).items():
            cells = value.__closure__ or () if isinstance(value, types.FunctionType) else ()
            found[name] = (value, *(cell.cell_contents for cell in cells))
            if isinstance(value, type) and value.__module__ == module.__name__:
                for attribute, member in vars(value).items():
                    found[f"{name}.{attribute}"] = (member,)
        found.pop(patches._APPLIED, None)
        return found

    changed = {}
    isolation.CHECKER = isolation.IsolationChecker("audit")
    for patch in [*patches.fix_patches(), *load_check.PATCHES, *isolation.PATCHES]:
        if not patches.matters(patch):
            continue
        target = importlib.import_module(patch.target)
        before = symbols(target)
        assert patch.check(target) is None, patch.name
        patch.apply(target)
        after = symbols(target)
        changed[patch.name] = sorted(
            name for name in before.keys() | after.keys()
            if any(a is not b for a, b in zip(before.get(name, ()), after.get(name, ())))
            or len(before.get(name, ())) != len(after.get(name, ()))
        )
    print("CHANGED", json.dumps(changed))
"""


def test_every_patch_lists_what_it_sets():
    every = [*fix_patches(), *load_check.PATCHES, *isolation.PATCHES]
    records = {patch.name: patch for patch in every}
    assert sorted(p.name for p in fix_patches()) == list(NAMES) and len(records) == len(every)
    assert all(patch.replaces and patch.fits for patch in records.values())
    records = {name: patch for name, patch in records.items() if matters(patch)}

    result = run_python(APPLY_EACH)
    line = next((x for x in result.stdout.splitlines() if x.startswith("CHANGED ")), None)
    assert line is not None, result.stdout[-2000:] + result.stderr[-3000:]
    changed = json.loads(line.removeprefix("CHANGED "))
    assert changed == {name: sorted(patch.replaces) for name, patch in records.items()}


def test_patch_catalogue_is_current():
    """docs/PATCHES.md is what the records write; where it fails, regenerate it:
    `python -m vllm_dsa_dbo.diagnostics.catalogue > docs/PATCHES.md`."""
    from vllm_dsa_dbo.diagnostics.catalogue import catalogue

    committed = Path(__file__).resolve().parents[1] / "docs" / "PATCHES.md"
    assert committed.read_text() == catalogue()
