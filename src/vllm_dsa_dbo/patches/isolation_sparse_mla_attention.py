"""Patch of `vllm.model_executor.layers.attention.sparse_mla_attention` for the
isolation checker (`VLLM_DSA_DBO_CHECK`)."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from vllm_dsa_dbo.diagnostics import isolation
from vllm_dsa_dbo.patches import Patch

PATCH = Patch(
    target="vllm.model_executor.layers.attention.sparse_mla_attention",
    replaces=(
        "SparseMLACommonImpl.record_logical_topk_ready",
        "SharedTopkIndicesBuffer.topk_indices_buffer",
    ),
    why=(
        "The isolation checker has to see each leader's write of the logical top-k "
        "and its ready event, and each follower's read of the logical buffer."
    ),
    how=(
        "Only with VLLM_DSA_DBO_CHECK=raise or audit, after the fix's patches: "
        "record_logical_topk_ready stamps the buffer and event a leader wrote, and "
        "the topk_indices_buffer getter checks what a follower reads against it."
    ),
    upstream="none: a diagnostic",
    remove_when="with the isolation checker",
)


def apply(target: ModuleType) -> None:
    from torch.compiler import is_dynamo_compiling

    checker = isolation.CHECKER
    impl_cls = target.SparseMLACommonImpl
    stock_record = impl_cls.record_logical_topk_ready

    @functools.wraps(stock_record)
    def record_logical_topk_ready(self: Any) -> None:
        stock_record(self)
        if is_dynamo_compiling():  # traced once, not a run-time write
            return
        group = self.index_group
        if group is not None and group.has_indexer and self.index_group_index == 0:
            checker.write(
                checker.layer(group, 0),
                self.topk_indices_buffer,
                isolation.state_of(group).logical_topk_ready,
            )

    mixin = target.SharedTopkIndicesBuffer
    stock_buffer = mixin.topk_indices_buffer

    @functools.wraps(stock_buffer.fget)
    def topk_indices_buffer(self: Any) -> Any:
        buffer = stock_buffer.fget(self)
        group = getattr(self, "index_group", None)
        index = getattr(self, "index_group_index", 0)
        if group is not None and index > 0:
            checker.read(checker.layer(group, index), "logical top-k", buffer)
        return buffer

    impl_cls.record_logical_topk_ready = record_logical_topk_ready
    mixin.topk_indices_buffer = property(topk_indices_buffer, stock_buffer.fset)
