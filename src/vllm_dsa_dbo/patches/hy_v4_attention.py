"""Patch of `vllm.models.hy_v4.nvidia.attention`."""

from __future__ import annotations

from types import ModuleType

from vllm_dsa_dbo.core import per_ubatch_indexer_op
from vllm_dsa_dbo.patches._shared import Patch


def apply(target: ModuleType) -> None:
    target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)


PATCH = Patch(
    name="hy_v4_attention",
    fits={"0.33.0": "a76783d45e1534e1", "0.34.0": "ac07aeee3f241b3a"},
    differs=(
        "vLLM 0.34.0: SparseAttnIndexer also takes skip_topk_buffer_clear and hands the "
        "op logits_dtype and dcp_direct_topk_max_rows; its buffer attribute is unchanged"
    ),
    target="vllm.models.hy_v4.nvidia.attention",
    replaces=("SparseAttnIndexer",),
    why=(
        "A HYV4 leader's Indexer builds a SparseAttnIndexer op holding the "
        "model-wide logical top-k buffer, and the op hands that one tensor to "
        "torch.ops.vllm.sparse_attn_indexer in every microbatch, while the "
        "followers read through their impls."
    ),
    how=(
        "The module's SparseAttnIndexer becomes a subclass whose "
        "topk_indices_buffer resolves through the layer's index group as the "
        "sparse MLA impl's does: the op writes the calling microbatch's logical "
        "buffer once hy_v4_model has set its index_group, and vLLM's buffer "
        "otherwise (unwired models, MTP drafts)."
    ),
    upstream="none: vllm PR #60734 fixes only the deepseek_v32 path",
    remove_when="the vLLM release whose HYV4 keeps its logical top-k per DBO microbatch",
    requires=("index_group", "sparse_mla_attention"),
    apply=apply,
)
