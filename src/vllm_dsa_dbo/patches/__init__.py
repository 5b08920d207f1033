"""The vLLM 0.33.0 seams this plugin patches, one module per patched vLLM module.

Each patch module opens with `PATCH`, its metadata as data (Why, How, Upstream,
Remove when), and defines `apply(target)`. `status`, docs and tests read
`PATCH` from here; nothing keeps a second list by hand.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Patch:
    """Why a vLLM module is patched and when the patch can go."""

    target: str
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
)

_APPLIED = "_vllm_dsa_dbo_patched"


def patch_modules() -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{name}") for name in PATCH_MODULES]


def call_after_init(cls: type, hook: Callable[[Any], None]) -> None:
    """Run `hook(instance)` after `cls.__init__`, keeping its signature."""
    stock_init = cls.__init__

    @functools.wraps(stock_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        stock_init(self, *args, **kwargs)
        hook(self)

    cls.__init__ = __init__


def _on_rocm() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_rocm()


def apply_all() -> list[Patch]:
    """Apply every patch once per process; returns the patches now in force."""
    patches = []
    for module in patch_modules():
        try:
            target = importlib.import_module(module.PATCH.target)
        except NotImplementedError:  # vLLM builds no such model here (hy_v4 on XPU)
            continue
        except ImportError:  # a ROCm-only module off ROCm; never on ROCm itself
            if not getattr(module, "ROCM_ONLY", False) or _on_rocm():
                raise
            continue
        if not getattr(target, _APPLIED, False):
            module.apply(target)
            setattr(target, _APPLIED, True)
        patches.append(module.PATCH)
    return patches
