"""Patch of `vllm.v1.attention.backends.mla.index_group` for the isolation checker
(`VLLM_DSA_DBO_CHECK`)."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from vllm_dsa_dbo.diagnostics import isolation
from vllm_dsa_dbo.patches import Patch

PATCH = Patch(
    target="vllm.v1.attention.backends.mla.index_group",
    replaces=("SparseMLAIndexGroup._convert_once",),
    why=(
        "The isolation checker has to see each leader's write of the physical "
        "top-k, valid counts and ready event, and each follower's read of them."
    ),
    how=(
        "Only with VLLM_DSA_DBO_CHECK=raise or audit, after the fix's patches: "
        "_convert_once stamps that state at layer 0 and checks it at a follower, "
        "in the microbatch's copy with the fix, in the group's own without."
    ),
    upstream="none: a diagnostic",
    remove_when="with the isolation checker",
)


def apply(target: ModuleType) -> None:
    checker = isolation.CHECKER
    group_cls = target.SparseMLAIndexGroup
    stock_convert = group_cls._convert_once

    @functools.wraps(stock_convert)
    def _convert_once(
        self: Any, layer_index: int, logical_topk_indices: Any, *args: Any, **kwargs: Any
    ) -> Any:
        state = isolation.state_of(self)
        cached = logical_topk_indices.shape[0] <= state.physical_topk_indices.shape[0]
        if cached and layer_index > 0:
            layer = checker.layer(self, layer_index)
            checker.read(layer, "physical top-k", state.physical_topk_indices)
            checker.read(layer, "valid counts", state.valid_topk_counts)
            checker.read(layer, "physical-ready event", state.physical_topk_ready)
        out = stock_convert(self, layer_index, logical_topk_indices, *args, **kwargs)
        if cached and layer_index == 0:
            checker.write(
                checker.layer(self, 0),
                state.physical_topk_indices,
                state.valid_topk_counts,
                state.physical_topk_ready,
            )
        return out

    group_cls._convert_once = _convert_once
