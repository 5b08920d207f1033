"""Patch of `vllm.models.deepseek_v32.amd.model`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.core import share_ubatch_logical_topk
from vllm_dsa_dbo.patches._shared import Patch, call_after_init


def keep_logical_topk_per_ubatch(model: Any) -> None:
    """Wire a ROCm DSA model's layers to per-microbatch logical top-k."""
    from vllm.models.deepseek_v32.amd.rocm import DeepseekV32MLAAttention

    layers = [m for m in model.modules() if isinstance(m, DeepseekV32MLAAttention)]
    share_ubatch_logical_topk(
        [layer.impl.index_group for layer in layers],
        [
            (layer.indexer_op, layer.impl.index_group)
            for layer in layers
            if layer.indexer_op is not None
        ],
    )


def apply(target: ModuleType) -> None:
    call_after_init(target.DeepseekV32Model, keep_logical_topk_per_ubatch)


PATCH = Patch(
    name="rocm_dsa_model",
    fits={"0.33.0": "ea772ef6d1e79788", "0.34.0": "d768371c0463365a"},
    differs=(
        "vLLM 0.34.0: the model keeps its buffer as self.topk_indices_buffer and builds "
        "pipeline-parallel top-k buffers (PP is refused with DBO)"
    ),
    target="vllm.models.deepseek_v32.amd.model",
    replaces=("DeepseekV32Model.__init__",),
    why=(
        "The ROCm DeepseekV32Model (GLM-5 / DeepSeek-V3.2 on ROCm) gives every "
        "layer one logical top-k buffer but no shared index-group builder: each "
        "layer's ROCMAiterMLASparseImpl builds a private single-layer group, and "
        "under DBO microbatch 1's leader overwrites the buffer before microbatch "
        "0's followers remap from it (a follower whose attention metadata the "
        "leader did not remap into, e.g. in another KV cache group)."
    ),
    how=(
        "Wraps DeepseekV32Model.__init__: with several microbatches and a layer "
        "that reuses another's top-k, every layer's group reads the logical buffer "
        "from the calling microbatch's token offset and each leader's indexer op "
        "resolves through its group, so writers and readers pick the same rows. "
        "The converted top-k lives in the attention metadata, which vLLM builds "
        "per microbatch (one metadata builder per microbatch): nothing allocated."
    ),
    upstream="none: vllm PR #60734 fixes only the CUDA deepseek_v32 path",
    remove_when="the vLLM release whose ROCm DSA keeps its logical top-k per DBO microbatch",
    requires=("rocm_dsa_attention",),
    apply=apply,
    rocm_only=True,
)
