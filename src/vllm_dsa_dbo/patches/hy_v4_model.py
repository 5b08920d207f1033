"""Patch of `vllm.models.hy_v4.nvidia.model`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.core import share_ubatch_logical_topk
from vllm_dsa_dbo.patches._shared import Patch, call_after_init


def keep_logical_topk_per_ubatch(model: Any) -> None:
    """Wire a HYV4 model's sparse layers to per-microbatch logical top-k."""
    from vllm.models.hy_v4.nvidia.attention import HYV4MLAAttention

    layers = [m for m in model.modules() if isinstance(m, HYV4MLAAttention) and m.is_sparse]
    share_ubatch_logical_topk(
        [layer.mla_attn.impl.index_group for layer in layers],
        [
            (layer.indexer.indexer_op, layer.mla_attn.impl.index_group)
            for layer in layers
            if layer.indexer is not None
        ],
    )


def apply(target: ModuleType) -> None:
    call_after_init(target.HYV4Model, keep_logical_topk_per_ubatch)


PATCH = Patch(
    name="hy_v4_model",
    fits={"0.33.0": "c7924ecd261ca4d9", "0.34.0": "e8e40c49a428636a"},
    differs=(
        "vLLM 0.34.0: HYV4Model.__init__ also builds pipeline-parallel top-k buffers (PP "
        "is refused with DBO)"
    ),
    target="vllm.models.hy_v4.nvidia.model",
    replaces=("HYV4Model.__init__",),
    why=(
        "HYV4Model gives every layer one logical top-k buffer but no shared "
        "index-group builder: each layer's impl builds a private single-layer "
        "group, no builder ever sees a follower, and under DBO microbatch 1's "
        "leader overwrites the buffer before microbatch 0's followers read it."
    ),
    how=(
        "Wraps HYV4Model.__init__: with several microbatches and a sparse layer "
        "that reuses another's top-k, every sparse layer's group reads the logical "
        "buffer from the calling microbatch's token offset and each leader's "
        "indexer op resolves through its group, so writers and readers pick the "
        "same rows. The physical top-k is converted and read within one layer: "
        "nothing allocated."
    ),
    upstream="none: vllm PR #60734 fixes only the deepseek_v32 path",
    remove_when="the vLLM release whose HYV4 keeps its logical top-k per DBO microbatch",
    requires=("hy_v4_attention",),
    apply=apply,
)
