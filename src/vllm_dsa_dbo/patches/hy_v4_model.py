"""Patch of `vllm.models.hy_v4.nvidia.model`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.patches import Patch
from vllm_dsa_dbo.ubatch_topk import share_ubatch_logical_topk

PATCH = Patch(
    target="vllm.models.hy_v4.nvidia.model",
    why=(
        "HYV4Model gives every layer one logical top-k buffer but no shared "
        "index-group builder: each layer's impl builds a private single-layer "
        "group, no builder ever sees a follower, and under DBO microbatch 1's "
        "leader overwrites the buffer before microbatch 0's followers read it."
    ),
    how=(
        "Wraps HYV4Model.__init__: with several microbatches and a sparse layer "
        "that reuses another's top-k, every sparse layer's group shares one extra "
        "logical buffer per extra microbatch and each leader's indexer op "
        "resolves through its group, so writers and readers pick the same copy. "
        "The physical top-k is converted and read within one layer: no copies."
    ),
    upstream="none: vllm PR #60734 fixes only the deepseek_v32 path",
    remove_when="the vLLM release whose HYV4 keeps its logical top-k per DBO microbatch",
)


def keep_logical_topk_per_ubatch(model: Any) -> None:
    """Wire a HYV4 model's followers and leaders to per-microbatch logical top-k.

    Leaves the model as built when an indexer op cannot resolve per
    microbatch; the loader then refuses it under DBO.
    """
    from vllm.models.hy_v4.nvidia.attention import HYV4MLAAttention

    layers = [
        m for m in model.modules() if isinstance(m, HYV4MLAAttention) and m.is_sparse
    ]
    groups = [layer.mla_attn.impl.index_group for layer in layers]
    if not groups or groups[0].num_ubatches < 2 or all(g.has_indexer for g in groups):
        return
    leaders = [layer for layer in layers if layer.indexer is not None]
    if not all(hasattr(layer.indexer.indexer_op, "index_group") for layer in leaders):
        return
    share_ubatch_logical_topk(groups)
    for layer in leaders:
        layer.indexer.indexer_op.index_group = layer.mla_attn.impl.index_group


def apply(target: ModuleType) -> None:
    model_cls = target.HYV4Model
    stock_init = model_cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        stock_init(self, *args, **kwargs)
        keep_logical_topk_per_ubatch(self)

    model_cls.__init__ = __init__
