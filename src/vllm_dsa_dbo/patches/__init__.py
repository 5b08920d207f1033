"""The vLLM 0.33.0 seams this plugin patches, one module per patched vLLM module.

Each patch module opens with `PATCH`, its metadata as data (the target's
symbols it sets, Why, How, Upstream, Remove when), and defines `apply(target)`.
It may define `REQUIRES`, the patches it is wrong without, and `check(target)`,
which tells what of the vLLM internals it relies on differs here. `status`, docs and tests read
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


def wire(apply: bool, names: tuple[str, ...] = PATCH_MODULES) -> dict[str, str | None]:
    """Each patch that matters here, and why it is left unapplied (None: in force).

    A patch is left unapplied when its target does not import, its check
    finds vLLM different, applying it raises, or a patch it needs is left
    unapplied. `apply=False` only tells what applying would do.
    """
    result: dict[str, str | None] = {}
    for module in patch_modules(names):
        name = short_name(module)
        try:
            target = importlib.import_module(module.PATCH.target)
        except NotImplementedError:  # vLLM builds no such model here (hy_v4 on XPU)
            continue
        except ImportError as e:  # a ROCm-only module off ROCm is fine; never on ROCm
            if getattr(module, "ROCM_ONLY", False) and not _on_rocm():
                continue
            result[name] = f"cannot import {module.PATCH.target}: {e}"
            continue
        requires = getattr(module, "REQUIRES", ())
        if any(r not in result for r in requires):  # needs a patch that does not matter here
            continue
        in_force = applied(target)
        if name in in_force:
            result[name] = None
            continue
        missing = [r for r in requires if result[r] is not None]
        try:
            if missing:
                reason = f"needs {', '.join(missing)}, left unapplied"
            else:
                reason = module.check(target) if hasattr(module, "check") else None
            if reason is None and apply:
                module.apply(target)
                setattr(target, _APPLIED, (*in_force, name))
        except Exception as e:  # a vLLM that differs must not break register()
            reason = f"{type(e).__name__}: {e}"
        result[name] = reason
    return result


def apply_all(names: tuple[str, ...] = PATCH_MODULES) -> set[str]:
    """Apply every patch of `names` `wire` allows, once per process; returns those in force.

    Each patch left unapplied gets one warning naming why: the models that
    need it are then refused at load, never corrupted.
    """
    from vllm.logger import init_logger

    from vllm_dsa_dbo import LOGGER_NAME

    logger = init_logger(LOGGER_NAME)
    applied = set()
    for name, reason in wire(apply=True, names=names).items():
        if reason is None:
            applied.add(name)
        else:
            logger.warning("vllm-dsa-dbo: patch %s left unapplied: %s", name, reason)
    return applied
