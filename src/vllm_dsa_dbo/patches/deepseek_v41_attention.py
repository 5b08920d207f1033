"""Patch of `vllm.models.deepseek_v41.attention`."""

from __future__ import annotations

from types import ModuleType

from vllm_dsa_dbo.core import thread_registry_mismatch
from vllm_dsa_dbo.patches._shared import Patch, unset_attributes
from vllm_dsa_dbo.ubatch_buffers import per_ubatch_buffers

OP_BUFFERS = ("topk_indices_buffer", "candidate_blocks")


def per_ubatch_op(op_cls: type) -> type:
    """`op_cls` whose top-k and candidate-block attributes resolve per microbatch."""
    op = type(op_cls.__name__, (op_cls,), {"__qualname__": op_cls.__qualname__})
    per_ubatch_buffers(op, *OP_BUFFERS)
    return op


def check(target: ModuleType) -> str | None:
    attention, indexer = target.DeepseekV4Attention, target.DeepseekV4Indexer
    ops = [getattr(indexer, name, None) for name in ("attn_cls", "mqa_cls")]
    if not all(isinstance(op, type) for op in ops):
        return f"DeepseekV4Indexer's attn_cls / mqa_cls are {ops}, not classes"
    return (
        thread_registry_mismatch()
        or unset_attributes(attention.__init__, "topk_indices_buffer", "candidate_block_buffer")
        or unset_attributes(indexer.__init__, "topk_indices_buffer")
        or next(filter(None, (unset_attributes(op.__init__, *OP_BUFFERS) for op in ops)), None)
    )


def apply(target: ModuleType) -> None:
    per_ubatch_buffers(target.DeepseekV4Attention, "topk_indices_buffer", "candidate_block_buffer")
    indexer = target.DeepseekV4Indexer
    per_ubatch_buffers(indexer, "topk_indices_buffer")
    indexer.attn_cls = per_ubatch_op(indexer.attn_cls)
    indexer.mqa_cls = per_ubatch_op(indexer.mqa_cls)


PATCH = Patch(
    name="deepseek_v41_attention",
    fits={"0.33.0": "ad7a241994480ad4", "0.34.0": "566eaf588f8bc639"},
    differs=(
        "vLLM 0.34.0: wo_a grouping, replay and Engram changes; the top-k and candidate "
        "buffers are set as before"
    ),
    target="vllm.models.deepseek_v41.attention",
    replaces=(
        "DeepseekV4Attention.topk_indices_buffer",
        "DeepseekV4Attention.candidate_block_buffer",
        "DeepseekV4Indexer.topk_indices_buffer",
        "DeepseekV4Indexer.attn_cls",
        "DeepseekV4Indexer.mqa_cls",
    ),
    why=(
        "DeepSeek-V4.1 layers that are no index source reuse the top-k an index "
        "source wrote into the model-wide topk_indices_buffer, and its later "
        "indexers mask their scores with the candidate blocks the "
        "candidate_source_layer_id indexer wrote into candidate_block_buffer; "
        "neither buffer has a microbatch dimension, so under DBO the other "
        "microbatch's index source overwrites them in between."
    ),
    how=(
        "The buffer attributes of DeepseekV4Attention (topk_indices_buffer, "
        "candidate_block_buffer), DeepseekV4Indexer (topk_indices_buffer) and of "
        "the indexer ops DeepseekV4Indexer builds (SparseAttnIndexer and "
        "SparseMQAIndexer subclasses: topk_indices_buffer, candidate_blocks) "
        "resolve, on every read, to the calling microbatch's copy of a buffer "
        "deepseek_v41_model registered; assignment stores the tensor as given, "
        "so runtime rebinding keeps working and unregistered buffers are vLLM's."
    ),
    upstream="vllm PR #56476 (open): per-microbatch sparse index state for DeepSeek-V4.1",
    remove_when="the vLLM release that merges PR #56476",
    apply=apply,
    check=check,
)
