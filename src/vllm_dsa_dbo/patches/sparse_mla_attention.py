"""Patch of `vllm.model_executor.layers.attention.sparse_mla_attention`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.core import resolve_logical_topk
from vllm_dsa_dbo.patches._shared import Patch


def check(target: ModuleType) -> str | None:
    """The stock getter reads the two attributes the inline copy below reads."""
    stock = target.SharedTopkIndicesBuffer.__dict__.get("topk_indices_buffer")
    if not isinstance(stock, property) or stock.fset is None:
        return "SharedTopkIndicesBuffer.topk_indices_buffer is not a settable property"
    names = set(stock.fget.__code__.co_names)
    if not {"_indexer", "_topk_indices_buffer", "topk_indices_buffer"} <= names:
        return f"SharedTopkIndicesBuffer.topk_indices_buffer reads {sorted(names)}"
    return None


def topk_indices_buffer(self: Any) -> Any:
    # vLLM's getter, inline: this property is read on every sparse MLA call.
    indexer = self._indexer
    buffer = self._topk_indices_buffer if indexer is None else indexer.topk_indices_buffer
    return resolve_logical_topk(getattr(self, "index_group", None), buffer)


def apply(target: ModuleType) -> None:
    mixin = target.SharedTopkIndicesBuffer
    mixin.topk_indices_buffer = property(topk_indices_buffer, mixin.topk_indices_buffer.fset)


PATCH = Patch(
    name="sparse_mla_attention",
    fits={"0.33.0": "eff710adf221a02c", "0.34.0": "eff710adf221a02c"},
    target="vllm.model_executor.layers.attention.sparse_mla_attention",
    replaces=("SharedTopkIndicesBuffer.topk_indices_buffer",),
    why=(
        "Every sparse MLA impl reads the model-wide logical top-k buffer through "
        "SharedTopkIndicesBuffer.topk_indices_buffer; under DBO both microbatches "
        "read and write rows [0:n) of that one buffer."
    ),
    how=(
        "The property getter resolves the buffer as vLLM's does (the indexer's, "
        "else the explicit one), then the calling microbatch's rows from the "
        "impl's index group; the setter is kept, so the MTP proposer still "
        "re-points draft impls through it."
    ),
    upstream=(
        "vllm PR #60734: SharedTopkIndicesBuffer.topk_indices_buffer returns the "
        "extra microbatch's logical buffer when dbo_current_ubatch_id() > 0."
    ),
    remove_when="the vLLM release that merges PR #60734 (not in 0.33.0)",
    requires=("index_group",),
    apply=apply,
    check=check,
)
