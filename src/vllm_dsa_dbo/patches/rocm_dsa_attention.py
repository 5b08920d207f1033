"""Patch of `vllm.models.deepseek_v32.amd.rocm`."""

from __future__ import annotations

from types import ModuleType

from vllm_dsa_dbo.core import per_ubatch_indexer_op
from vllm_dsa_dbo.patches._shared import IMPL_TOPK_INDICES_BUFFER, Patch


def apply(target: ModuleType) -> None:
    target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)
    target.DeepseekV32MLAAttention.topk_indices_buffer = IMPL_TOPK_INDICES_BUFFER


PATCH = Patch(
    name="rocm_dsa_attention",
    fits={"0.33.0": "53138885a64d589a", "0.34.0": "96b7dbf13e6ddb1f"},
    differs=(
        "vLLM 0.34.0: SparseAttnIndexer also takes skip_topk_buffer_clear and hands the "
        "op logits_dtype and dcp_direct_topk_max_rows; its buffer attribute is unchanged"
    ),
    target="vllm.models.deepseek_v32.amd.rocm",
    replaces=("SparseAttnIndexer", "DeepseekV32MLAAttention.topk_indices_buffer"),
    why=(
        "A ROCm DSA leader's DeepseekV32MLAAttention builds its own "
        "SparseAttnIndexer op holding the model-wide logical top-k buffer, and "
        "forward_hip hands that one tensor to the indexer kernel in every "
        "microbatch, while its fused_norm_rope call (through "
        "DeepseekV32Attention.topk_indices_buffer) and the impls' remap resolve "
        "through the impl."
    ),
    how=(
        "The module's SparseAttnIndexer becomes a subclass whose "
        "topk_indices_buffer resolves through the layer's index group as the "
        "sparse MLA impl's does: the op writes the calling microbatch's logical "
        "buffer once rocm_dsa_model has set its index_group, and vLLM's buffer "
        "otherwise (unwired models, MTP drafts). DeepseekV32MLAAttention's own "
        "topk_indices_buffer, which fused_norm_rope clears, reads and assigns the "
        "impl's: deepseek_v32_attention makes its base class's so on a released vLLM, "
        "but a vLLM carrying the upstream change fixes only the base class's writers."
    ),
    upstream="none: vllm PR #60734 fixes only the CUDA deepseek_v32 path",
    remove_when="the vLLM release whose ROCm DSA keeps its logical top-k per DBO microbatch",
    requires=("index_group", "sparse_mla_attention"),
    apply=apply,
    rocm_only=True,
)
