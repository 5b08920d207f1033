"""Patch of `vllm.models.deepseek_v32.attention`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.patches._shared import (
    IMPL_TOPK_INDICES_BUFFER,
    Patch,
    call_after_init,
)


def mark_wired(attention: Any) -> None:
    """The layer's writers take the buffer from its impl: its group may resolve it."""
    group = getattr(attention.impl, "index_group", None)
    if group is not None:
        group.leader_writes_follow_impl = True


def apply(target: ModuleType) -> None:
    target.DeepseekV32Attention.topk_indices_buffer = IMPL_TOPK_INDICES_BUFFER
    call_after_init(target.DeepseekV32Attention, mark_wired)


PATCH = Patch(
    name="deepseek_v32_attention",
    fits={"0.33.0": "d3f26c9a34c0b99d", "0.34.0": "2aa48782dee21fec"},
    differs=(
        "vLLM 0.34.0: leaders by compute_skip_topk_layers (indexer_types too), a ShardQ "
        "branch reading from topk_start, shardq_eligible; its writers still read "
        "self.topk_indices_buffer"
    ),
    target="vllm.models.deepseek_v32.attention",
    replaces=(
        "DeepseekV32Attention.__init__",
        "DeepseekV32Attention.topk_indices_buffer",
    ),
    why=(
        "DeepseekV32Attention keeps its own plain topk_indices_buffer attribute "
        "and hands it to the leader's writers (fused_norm_rope, "
        "sparse_attn_indexer), so writers would bypass the impl's per-microbatch "
        "resolution that the followers read through."
    ),
    how=(
        "A class property topk_indices_buffer that reads and assigns the impl's "
        "property: writers and readers resolve the same buffer, and the MTP "
        "proposer's re-pointing reaches the impl. After __init__ the layer marks "
        "its impl's index group as wired; only wired groups resolve per microbatch."
    ),
    upstream=(
        "vllm PR #60734: the leader's writers take the buffer from self.impl.topk_indices_buffer."
    ),
    remove_when="the vLLM release that merges PR #60734 (not in 0.33.0)",
    requires=("index_group", "sparse_mla_attention"),
    apply=apply,
)
