"""The fix's patches of vLLM, one module per patched vLLM module, and how they go on.

Each module defines `PATCH`, its `Patch` record; `status`, docs and tests read the
records, and the order they go on comes from their `requires`: no list is kept by hand.
"""

from __future__ import annotations

import functools
import graphlib
import importlib
import pkgutil
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from vllm_dsa_dbo import carried, settings
from vllm_dsa_dbo.patches._on_import import is_pending, on_first_import
from vllm_dsa_dbo.patches._shared import Patch, where

# The fix's patch modules: every module of this package but the underscored ones.
NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name[0] != "_"))

# vLLM imports a model package's modules only in a process that builds that model. On CUDA,
# importing one imports FlashInfer, which initializes CUDA, and a vLLM engine core with CUDA
# initialized spawns its workers instead of forking them: patches of such modules are applied
# when vLLM imports them.
MODEL_PACKAGES = "vllm.models."

# On each target module: the names of the patches applied to it.
_APPLIED = "_vllm_dsa_dbo_patched"
# This process's outcome of every patch applied or left unapplied so far (None: in force).
_OUTCOMES: dict[str, str | None] = {}
# The patches this vLLM's own code makes redundant, and what it has in their place.
CARRIED: dict[str, str] = {}
# The per-microbatch state and its lookup: the upstream change's core, in vLLM's form or the
# plugin's. The paths the change leaves out work on top of either, not on a mix.
CORE = {"index_group", "sparse_mla_attention"}
# Per (class or module, attribute) a patch set in this process: every value the patches set
# there, a later patch's over an earlier one's included.
_INSTALLED: dict[tuple[Any, str], list[Any]] = {}


@functools.cache
def fix_patches() -> tuple[Patch, ...]:
    """The fix's patches, each after those it requires."""
    records = {name: importlib.import_module(f"{__name__}.{name}").PATCH for name in NAMES}
    graph = graphlib.TopologicalSorter({name: p.requires for name, p in records.items()})
    return tuple(records[name] for name in graph.static_order())


def applied(target: ModuleType) -> tuple[str, ...]:
    """The names of the patches applied to `target` (the isolation checker's included)."""
    return getattr(target, _APPLIED, ())


def _on_rocm() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_rocm()


def _import(patch: Patch) -> ModuleType | None:
    """`patch`'s target, or None where it does not matter here."""
    if not matters(patch):
        return None
    try:
        return importlib.import_module(patch.target)
    except NotImplementedError:  # vLLM builds no such model here (hy_v4 on XPU)
        return None
    except ImportError:  # a ROCm-only module off ROCm is fine; never on ROCm
        if patch.rocm_only and not _on_rocm():
            return None
        raise


def _outcome(patch: Patch, target: ModuleType, known: dict[str, str | None]) -> str | None:
    """Why `patch` is left unapplied on `target`, given the outcomes `known` of those it
    requires; None when it is in force, or would be once applied."""
    here = release()
    assert here is not None  # a patch matters only in a supported release
    form, what = carried.form(patch.name, target, patch.replaces, here, patch.fits[here])
    if form is carried.Form.CARRIED:
        CARRIED[patch.name] = what
        return None
    if patch.name in applied(target):
        return None
    needs = [f"{r}, left unapplied" for r in patch.requires if known[r] is not None]
    # Patches built on the core work on top of vLLM's own form of it, whole; of any other
    # patch, vLLM's own form is not the one the patches needing it were written against.
    needs += [
        f"the plugin's {r}, which this vLLM carries in its own form"
        for r in patch.requires
        if r in CARRIED and not (r in CORE and CORE <= CARRIED.keys())
    ]
    if needs:
        return "needs " + "; ".join(needs)
    return patch.check(target) or (what if form is carried.Form.CHANGED else None)


def matters(patch: Patch) -> bool:
    """Whether `patch` has a seam in this release (Mistral Large 4's first came in 0.34.0)."""
    return release() in patch.fits


def release() -> str | None:
    """The supported release whose seams this vLLM must fit (None: none)."""
    import vllm

    return settings.release_of(vllm.__version__)


def diagnose(patches: Iterable[Patch]) -> dict[str, str | None]:
    """What applying `patches` here would do: each that matters here, and why it would be
    left unapplied (None: in force). Imports every target, applies nothing."""
    found: dict[str, str | None] = {}
    for patch in patches:
        try:
            target = _import(patch)
        except ImportError as e:
            found[patch.name] = f"cannot import {patch.target}: {e}"
            continue
        if target is not None and all(r in found for r in patch.requires):
            try:
                found[patch.name] = _outcome(patch, target, found)
            except Exception as e:
                found[patch.name] = f"{type(e).__name__}: {e}"
    return found


def apply_all(patches: Iterable[Patch]) -> set[str]:
    """Apply each of `patches` that matters here, once per process, a model package's module
    as vLLM imports it; returns the names of those in force now.

    Each patch left unapplied gets one warning naming why: the models that need it are
    then refused at load, never corrupted.
    """
    patches = list(patches)
    by_name = {patch.name: patch for patch in patches}
    for patch in patches:
        if patch.target.startswith(MODEL_PACKAGES) and matters(patch):
            on_first_import(patch.target, functools.partial(_apply, patch, by_name))
            continue
        try:
            target = _import(patch)
        except ImportError as e:
            _settle(patch, f"cannot import {patch.target}: {e}")
            continue
        if target is not None:
            _apply(patch, by_name, target)
    return {p.name for p in patches if p.name in _OUTCOMES and _OUTCOMES[p.name] is None}


def _apply(patch: Patch, by_name: dict[str, Patch], target: ModuleType) -> None:
    """Apply `patch` to `target` unless `_outcome` says why not; never raises."""
    try:
        for name in patch.requires:  # one whose module vLLM has not imported yet goes first
            if name not in _OUTCOMES and is_pending(by_name[name].target):
                importlib.import_module(by_name[name].target)
        if not all(r in _OUTCOMES for r in patch.requires):
            return  # it needs a patch that does not matter here: neither does it
        reason = _outcome(patch, target, _OUTCOMES)
        if reason is None and patch.name not in CARRIED and patch.name not in applied(target):
            patch.apply(target)
            setattr(target, _APPLIED, (*applied(target), patch.name))
            for owner, attribute in _symbols(patch, target):
                _INSTALLED.setdefault((owner, attribute), []).append(vars(owner).get(attribute))
    except Exception as e:  # a vLLM that differs must not break register() or an import
        reason = f"{type(e).__name__}: {e}"
    _settle(patch, reason)


def _symbols(patch: Patch, target: ModuleType) -> list[tuple[Any, str]]:
    """The class or module that holds each symbol `patch` sets on `target`, and its name."""
    found = []
    for symbol in patch.replaces:
        owner, _, attribute = symbol.rpartition(".")
        found.append((getattr(target, owner) if owner else target, attribute))
    return found


def overridden() -> list[str]:
    """Each symbol the patches set in this process that other code has since set over them
    (another plugin's register(), say), by what, and whether the plugin's is still under it."""
    found = []
    for (owner, attribute), ours in _INSTALLED.items():
        current = vars(owner).get(attribute)
        if any(current is value for value in ours):
            continue
        verb = "wraps" if _wraps(current, ours) else "replaces"
        found.append(f"other code {verb} {_name(owner)}.{attribute} (by {where(current)})")
    return found


def _name(owner: Any) -> str:
    """A module's or class's dotted name."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return owner.__name__


def _wraps(current: Any, ours: list[Any]) -> bool:
    """Whether `current` (a function, or a property's getter) wraps one of `ours`, as
    functools.wraps marks a wrapper."""
    layer, under = getattr(current, "fget", current), [getattr(v, "fget", v) for v in ours]
    while layer is not None and not any(layer is value for value in under):
        layer = getattr(layer, "__wrapped__", None)
    return layer is not None


def _settle(patch: Patch, reason: str | None) -> None:
    _OUTCOMES[patch.name] = reason
    if reason is not None:
        settings.logger().warning("vllm-dsa-dbo: patch %s left unapplied: %s", patch.name, reason)
