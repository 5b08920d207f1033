"""Patch of `vllm.model_executor.layers.mla`."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm.platforms import current_platform

from vllm_dsa_dbo.core import wire_indexer_op_leader
from vllm_dsa_dbo.patches._shared import Patch, call_after_init

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup


def share_logical_topk_ready(group: SparseMLAIndexGroup) -> None:
    """Every microbatch of `group` records and waits on the group's own
    logical-ready event.

    A compiled model records it from traced code
    (`MultiHeadLatentAttentionWrapper.forward`), so the graph records the
    event the tracer saw, microbatch 0's, in every microbatch; another
    microbatch's own event would never be recorded and its wait would be a
    no-op, racing the indexer. One event is enough: the microbatches share one
    compute stream, and a leader records and waits within one layer, with no
    yield in between, so the latest record always follows its own indexer.
    Call it outside microbatches (at model build).
    """
    for state in group.ubatch_topk_states:
        state.logical_topk_ready = group.logical_topk_ready


def wire(wrapper: Any) -> None:
    group = getattr(getattr(wrapper.mla_attn, "impl", None), "index_group", None)
    if group is None:
        return
    share_logical_topk_ready(group)
    # Off CUDA the indexer op is another one (ROCm's aiter op): left unwired, refused.
    indexer_op = getattr(wrapper.indexer, "indexer_op", None)
    if indexer_op is not None and not wrapper.skip_topk and current_platform.is_cuda():
        wire_indexer_op_leader(indexer_op.k_cache.prefix, group)


def apply(target: ModuleType) -> None:
    call_after_init(target.MultiHeadLatentAttentionWrapper, wire)


PATCH = Patch(
    name="mla",
    fits={"0.33.0": "cffe71b09e0ba928", "0.34.0": "114306e41ad02e4c"},
    differs=("vLLM 0.34.0: __init__ also takes shardq_eligible, which the hook passes through"),
    target="vllm.model_executor.layers.mla",
    replaces=("MultiHeadLatentAttentionWrapper.__init__",),
    why=(
        "MultiHeadLatentAttentionWrapper (the deepseek_v2 / glm4_moe_lite DSA "
        "layers, torch.compile'd) writes the leader's top-k through the "
        "registered indexer op and records the logical-ready event from traced "
        "code, so the event is microbatch 0's in every microbatch."
    ),
    how=(
        "After __init__, a CUDA leader's indexer op is wired to its index group "
        "(the sparse_attn_indexer patch then resolves its buffer per microbatch, "
        "as the group's impls do), and the group's extra microbatches share its "
        "logical-ready event, the one the traced graph records."
    ),
    upstream=("none yet: PR #60734 covers the eager deepseek_v32 path only"),
    remove_when="a vLLM release that keeps the compiled DSA path's top-k per microbatch",
    requires=("index_group", "sparse_mla_attention", "sparse_attn_indexer"),
    apply=apply,
)
