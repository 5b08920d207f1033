"""The vLLM 0.33.0 seams this plugin patches, one module per patched vLLM module.

Each patch module opens with `PATCH`, its metadata as data (the target's
symbols it sets, Why, How, Upstream, Remove when), and defines `apply(target)`.
It may define `REQUIRES`, the patches it is wrong without, `check(target)`,
which tells what of the vLLM internals it relies on differs here, and
`in_tree(target)`, which tells what the target's own code has that makes the
patch redundant (a vLLM carrying the upstream change). `status`, docs and tests read
`PATCH` from here; nothing keeps a second list by hand.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_dsa_dbo.patches._on_import import is_pending, on_first_import


@dataclass(frozen=True)
class Patch:
    """Why a vLLM module is patched and when the patch can go."""

    target: str
    # The target module's symbols `apply` sets, as `name` or `Class.attribute`.
    replaces: tuple[str, ...]
    why: str
    how: str
    upstream: str
    remove_when: str


# Order matters: the index-group state exists before anything resolves it.
PATCH_MODULES = (
    "index_group",
    "sparse_mla_attention",
    "deepseek_v32_attention",
    "sparse_attn_indexer",
    "mla",
    "hy_v4_attention",
    "hy_v4_model",
    "rocm_dsa_attention",
    "rocm_dsa_model",
    "deepseek_v41_attention",
    "deepseek_v41_model",
    "base_loader",
    "tensorizer",
)

# The isolation checker's, applied by `diagnostics.isolation.install` after the fix's.
CHECK_PATCH_MODULES = (
    "isolation_sparse_mla_attention",
    "isolation_index_group",
    "isolation_deepseek_v41_attention",
)

# With these in force every model build is checked at load; without, the guard refuses.
LOAD_CHECK_MODULES = frozenset({"base_loader", "tensorizer"})

# On each target module: the names of the patches applied to it.
_APPLIED = "_vllm_dsa_dbo_patched"


def applied(target: ModuleType) -> tuple[str, ...]:
    """The names of the patches applied to `target` (the checker's included)."""
    return getattr(target, _APPLIED, ())


def patch_modules(names: tuple[str, ...] = PATCH_MODULES) -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def call_after_init(cls: type, hook: Callable[[Any], None]) -> None:
    """Run `hook(instance)` after `cls.__init__`, keeping its signature."""
    stock_init = cls.__init__

    @functools.wraps(stock_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        stock_init(self, *args, **kwargs)
        hook(self)

    __init__.after_init = hook
    cls.__init__ = __init__


def run_after_init(instance: Any) -> None:
    """The hooks `call_after_init` hung on `type(instance)`, for an instance
    built without `__init__` (the CPU stack's attention modules)."""
    init = type(instance).__init__
    hooks = []
    while hasattr(init, "after_init"):
        hooks.append(init.after_init)
        init = init.__wrapped__
    for hook in reversed(hooks):
        hook(instance)


def replace_function(module: ModuleType, name: str, replacement: Callable) -> None:
    """Set `module.name` to `replacement`, and every module's alias of the stock one.

    Modules that imported the function by value before this call hold the
    stock function under the same name; they get the replacement too.
    """
    stock = getattr(module, name)
    for holder in list(sys.modules.values()):
        # The module's own dict: a module-level __getattr__ may import or raise.
        if getattr(holder, "__dict__", {}).get(name) is stock:
            setattr(holder, name, replacement)
    setattr(module, name, replacement)


def _on_rocm() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_rocm()


def short_name(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[1]


# vLLM imports a model package's modules only in a process that builds that model. On CUDA,
# importing one imports FlashInfer, which initializes CUDA, and a vLLM engine core with CUDA
# initialized spawns its workers instead of forking them: patches of such modules are applied
# when vLLM imports them.
MODEL_PACKAGES = "vllm.models."

# This process's outcome of every patch applied or left unapplied so far (None: in force).
_OUTCOMES: dict[str, str | None] = {}
# The patches this vLLM's own code makes redundant, and what it has in their place.
CARRIED: dict[str, str] = {}
# A patch that needs one that does not matter here (a ROCm-only patch off ROCm).
_IRRELEVANT = object()


def wire(apply: bool, names: tuple[str, ...] = PATCH_MODULES) -> dict[str, str | None]:
    """Each patch that matters here, and why it is left unapplied (None: in force).

    A patch is left unapplied when its target does not import, its check
    finds vLLM different, applying it raises, or a patch it needs is left
    unapplied. `apply=False` only tells what applying would do. With
    `apply=True`, a patch of a model package's module is left out: it is wired
    (and warns if left unapplied) at once if vLLM imported that module already,
    else when it does.
    """
    result: dict[str, str | None] = {}
    known = _OUTCOMES if apply else result
    for module in patch_modules(names):
        name = short_name(module)
        target_name = module.PATCH.target
        if apply and target_name.startswith(MODEL_PACKAGES):
            on_first_import(target_name, functools.partial(_wire_imported, module))
            continue
        try:
            target = importlib.import_module(target_name)
        except NotImplementedError:  # vLLM builds no such model here (hy_v4 on XPU)
            continue
        except ImportError as e:  # a ROCm-only module off ROCm is fine; never on ROCm
            if getattr(module, "ROCM_ONLY", False) and not _on_rocm():
                continue
            result[name] = known[name] = f"cannot import {target_name}: {e}"
            continue
        outcome = _outcome(module, target, known, apply)
        if outcome is not _IRRELEVANT:
            result[name] = known[name] = outcome
    return result


def _outcome(module: ModuleType, target: ModuleType, known: dict, apply: bool) -> Any:
    """Why `module`'s patch of `target` is left unapplied, None if in force, or _IRRELEVANT."""
    name = short_name(module)
    carried = module.in_tree(target) if hasattr(module, "in_tree") else None
    if carried is not None:
        CARRIED[name] = carried
        return None
    requires = getattr(module, "REQUIRES", ())
    for required, patch in zip(requires, patch_modules(requires)):
        # One whose module vLLM has not imported yet is wired first.
        if required not in known and is_pending(patch.PATCH.target):
            importlib.import_module(patch.PATCH.target)
    if any(r not in known for r in requires):
        return _IRRELEVANT
    in_force = applied(target)
    if name in in_force:
        return None
    needs = [f"{r}, left unapplied" for r in requires if known[r] is not None]
    # vLLM's own form of a patch is not the one the patches needing it were written against.
    needs += [
        f"the plugin's {r}, which this vLLM carries in its own form"
        for r in requires
        if r in CARRIED
    ]
    try:
        if needs:
            reason = "needs " + "; ".join(needs)
        else:
            reason = module.check(target) if hasattr(module, "check") else None
        if reason is None and apply:
            module.apply(target)
            setattr(target, _APPLIED, (*in_force, name))
    except Exception as e:  # a vLLM that differs must not break register()
        reason = f"{type(e).__name__}: {e}"
    return reason


def _wire_imported(module: ModuleType, target: ModuleType) -> None:
    """`wire(apply=True)` of one patch as vLLM imports its target; never raises into it."""
    try:
        outcome = _outcome(module, target, _OUTCOMES, apply=True)
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    if outcome is not _IRRELEVANT:
        _OUTCOMES[short_name(module)] = outcome
        if outcome is not None:
            _warn_unapplied(short_name(module), outcome)


def _warn_unapplied(name: str, reason: str) -> None:
    from vllm.logger import init_logger

    from vllm_dsa_dbo import LOGGER_NAME

    init_logger(LOGGER_NAME).warning("vllm-dsa-dbo: patch %s left unapplied: %s", name, reason)


def apply_all(names: tuple[str, ...] = PATCH_MODULES) -> set[str]:
    """Apply every patch of `names` `wire` allows, once per process; returns those in force
    outside model packages (a model package's module is patched as vLLM imports it).

    Each patch left unapplied gets one warning naming why: the models that
    need it are then refused at load, never corrupted.
    """
    applied = set()
    for name, reason in wire(apply=True, names=names).items():
        if reason is None:
            applied.add(name)
        else:
            _warn_unapplied(name, reason)
    return applied
