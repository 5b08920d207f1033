"""Patch of `vllm.models.mistral.nvidia.attention`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.patches._shared import Patch, call_after_init


def wire(attention: Any) -> None:
    """A leader's writers take their group from its impl; only then may the group resolve
    per microbatch (an unwired leader's group stays shared, and is refused under DBO)."""
    indexer = attention.indexer
    group = getattr(getattr(attention.attn, "impl", None), "index_group", None)
    if indexer is None or group is None:
        return
    writers = (indexer, indexer.indexer_op)
    if not all(hasattr(writer, "index_group") for writer in writers):
        return
    for writer in writers:
        writer.index_group = group
    group.leader_writes_follow_impl = True


def apply(target: ModuleType) -> None:
    call_after_init(target.MistralMLAAttention, wire)


PATCH = Patch(
    name="mistral_attention",
    fits={"0.34.0": "0b3ec8ebc5b16578"},
    target="vllm.models.mistral.nvidia.attention",
    replaces=("MistralMLAAttention.__init__",),
    why=(
        "MistralMLAAttention (Mistral Large 4 on CUDA, index_sharing) builds its "
        "MistralIndexer before its MLAAttention, whose impl joins the model's one "
        "SparseMLAIndexGroupBuilder: a leader's writers never learn the index "
        "group its 'shared' followers read through."
    ),
    how=(
        "After __init__, a leader hands its impl's index group to its "
        "MistralIndexer and that indexer's op (both made per-microbatch by "
        "mistral_indexer) and marks the group wired; the group's extra "
        "microbatch state and logical buffers come from the index_group patch, "
        "and record_logical_topk_ready records the calling microbatch's event."
    ),
    upstream="none: vllm PR #60734 fixes only the deepseek_v32 path",
    remove_when="the vLLM release whose Mistral Large 4 keeps its top-k per DBO microbatch",
    requires=("mistral_indexer",),
    apply=apply,
)
