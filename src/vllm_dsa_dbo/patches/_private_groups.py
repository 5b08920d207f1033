"""Wiring for models whose layers build private index groups (HYV4, ROCm DSA)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_dsa_dbo.core import UbatchLogicalTopk, resolve_logical_topk

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup


def per_ubatch_indexer_op(indexer_op_cls: type) -> type:
    """`indexer_op_cls` writing the calling microbatch's logical top-k.

    Models without a shared index-group builder (HYV4, ROCm DSA) give each
    leader's indexer op the model-wide buffer. Once `share_ubatch_logical_topk`
    has set the op's `index_group`, the op resolves that buffer as the
    followers' impls do; before that (unwired models, MTP drafts) it is vLLM's.
    """

    class IndexerOp(indexer_op_cls):
        index_group = None

        @property
        def topk_indices_buffer(self) -> torch.Tensor:
            return resolve_logical_topk(self.index_group, self._topk_indices_buffer)

        @topk_indices_buffer.setter
        def topk_indices_buffer(self, buffer: torch.Tensor) -> None:
            self._topk_indices_buffer = buffer

    IndexerOp.__name__ = IndexerOp.__qualname__ = indexer_op_cls.__name__
    return IndexerOp


def share_ubatch_logical_topk(
    groups: list[SparseMLAIndexGroup | None], leaders: list[tuple[Any, SparseMLAIndexGroup]]
) -> None:
    """Per-microbatch logical top-k for a model whose layers build private groups.

    `groups` holds every sparse layer's group and `leaders` each leader's
    (indexer op, group). Such groups convert and read their physical top-k
    within one layer, so only the shared logical buffer needs copies. Wires
    nothing unless several microbatches run, some layer reuses another's
    top-k, all groups share one buffer and every leader's op resolves through
    its group (`per_ubatch_indexer_op`): the loader then refuses the model
    under DBO.
    """
    if not groups or any(g is None for g in groups) or groups[0].num_ubatches < 2:
        return
    buffer = groups[0].logical_topk_indices
    if all(g.has_indexer for g in groups):
        return
    if any(g.logical_topk_indices is not buffer for g in groups):
        return
    if not all(hasattr(op, "index_group") for op, _ in leaders):
        return
    extra = UbatchLogicalTopk(buffer, groups[0].num_ubatches)
    extra.allocate()
    for group in groups:
        group.ubatch_logical_topk = extra
        group.leader_writes_follow_impl = True
    for op, group in leaders:
        op.index_group = group
