"""Patch of `vllm.model_executor.layers.attention.sparse_mla_attention`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.patches import Patch
from vllm_dsa_dbo.ubatch_topk import resolve_logical_topk

PATCH = Patch(
    target="vllm.model_executor.layers.attention.sparse_mla_attention",
    why=(
        "Every sparse MLA impl reads the model-wide logical top-k buffer through "
        "SharedTopkIndicesBuffer.topk_indices_buffer; under DBO both microbatches "
        "read and write rows [0:n) of that one buffer."
    ),
    how=(
        "The property getter resolves the stock buffer, then the calling "
        "microbatch's copy from the impl's index group; the setter is kept, so the "
        "MTP proposer still re-points draft impls through it."
    ),
    upstream=(
        "vllm PR #60734: SharedTopkIndicesBuffer.topk_indices_buffer returns the "
        "extra microbatch's logical buffer when dbo_current_ubatch_id() > 0."
    ),
    remove_when="the vLLM release that merges PR #60734 (not in 0.33.0)",
)


def apply(target: ModuleType) -> None:
    mixin = target.SharedTopkIndicesBuffer
    stock = mixin.topk_indices_buffer

    def topk_indices_buffer(self: Any) -> Any:
        return resolve_logical_topk(
            getattr(self, "index_group", None), stock.fget(self)
        )

    mixin.topk_indices_buffer = property(topk_indices_buffer, stock.fset)
