"""Patch of `vllm.models.mistral.nvidia.indexer`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.core import per_ubatch_indexer_op, resolve_logical_topk
from vllm_dsa_dbo.patches._shared import Patch


def _get(self: Any) -> Any:
    return resolve_logical_topk(self.index_group, self._topk_indices_buffer)


def _set(self: Any, buffer: Any) -> None:
    self._topk_indices_buffer = buffer


def apply(target: ModuleType) -> None:
    indexer = target.MistralIndexer
    indexer.index_group = None
    indexer.topk_indices_buffer = property(_get, _set)
    target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)


PATCH = Patch(
    name="mistral_indexer",
    fits={"0.34.0": "08b74acbebadbfc7"},
    target="vllm.models.mistral.nvidia.indexer",
    replaces=(
        "MistralIndexer.index_group",
        "MistralIndexer.topk_indices_buffer",
        "SparseAttnIndexer",
    ),
    why=(
        "A Mistral Large 4 leader's MistralIndexer writes the model-wide logical "
        "top-k twice per step, both times into the one tensor it was built with: "
        "fused_indexer_q_ssmax_rope_quant clears its rows (topk_indices=, with "
        "fuse_k_cache) and its SparseAttnIndexer op hands it to "
        "torch.ops.vllm.sparse_attn_indexer, while the followers of its index "
        "group read through their impls."
    ),
    how=(
        "MistralIndexer.topk_indices_buffer becomes a property resolving through "
        "the indexer's index_group as the sparse MLA impl's does, and the "
        "module's SparseAttnIndexer a subclass whose topk_indices_buffer does the "
        "same: both writers take the calling microbatch's logical buffer once "
        "mistral_attention has given them the leader's group, and vLLM's buffer "
        "otherwise."
    ),
    upstream="none: vllm PR #60734 fixes only the deepseek_v32 path",
    remove_when="the vLLM release whose Mistral Large 4 keeps its top-k per DBO microbatch",
    requires=("index_group", "sparse_mla_attention"),
    apply=apply,
)
