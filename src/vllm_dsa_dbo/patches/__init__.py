"""The vLLM 0.33.0 seams this plugin patches, one module per patched vLLM module.

Each patch module opens with `PATCH`, its metadata as data (Why, How, Upstream,
Remove when), and defines `apply(target)`. `status`, docs and tests read
`PATCH` from here; nothing keeps a second list by hand.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


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
    "hy_v4_attention",
    "hy_v4_model",
    "base_loader",
)

_APPLIED = "_vllm_dsa_dbo_patched"


def patch_modules() -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{name}") for name in PATCH_MODULES]


def apply_all() -> list[Patch]:
    """Apply every patch once per process; returns the patches now in force."""
    patches = []
    for module in patch_modules():
        try:
            target = importlib.import_module(module.PATCH.target)
        except NotImplementedError:  # vLLM builds no such model here (hy_v4 on XPU)
            continue
        if not getattr(target, _APPLIED, False):
            module.apply(target)
            setattr(target, _APPLIED, True)
        patches.append(module.PATCH)
    return patches
