"""Patch of `vllm.models.deepseek_v41.attention` for the isolation checker
(`VLLM_DSA_DBO_CHECK`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dsa_dbo.diagnostics import isolation
from vllm_dsa_dbo.patches import Patch

PATCH = Patch(
    target="vllm.models.deepseek_v41.attention",
    replaces=("DeepseekV4Attention._sparse_indexer_and_attn",),
    why=(
        "The isolation checker has to see DeepSeek-V4.1's hand-offs outside index "
        "groups: the top-k an index source writes for later layers, and the "
        "candidate blocks the candidate source writes for later indexers."
    ),
    how=(
        "Only with VLLM_DSA_DBO_CHECK=raise or audit, after the fix's patches: "
        "_sparse_indexer_and_attn checks the top-k and candidate blocks a layer "
        "reads before it runs and stamps what it wrote after."
    ),
    upstream="none: a diagnostic",
    remove_when="with the isolation checker",
)


def checked_v41_layer(
    checker: isolation.IsolationChecker, stock: Callable[..., None]
) -> Callable[..., None]:
    """DeepSeek-V4.1's `_sparse_indexer_and_attn`, checking its hand-offs.

    Before the layer runs: a layer reusing an index source's top-k reads the
    top-k buffer, an indexer masking with earlier candidates reads the
    candidate-block buffer. After it: an index source has written the top-k
    (its indexer op, or the short-context fill before it), the candidate
    source's op the candidates.
    """
    from vllm_dsa_dbo.patches.deepseek_v41_model import reads_candidates, reuses_topk

    @functools.wraps(stock)
    def _sparse_indexer_and_attn(self: Any, hidden_states: Any, index_q: Any, *args: Any) -> None:
        layer = f"V4.1 layer {self.layer_id}"
        if reuses_topk(self):
            checker.read(layer, "V4.1 top-k", self.topk_indices_buffer)
        if reads_candidates(self) and index_q is not None:
            checker.read(layer, "V4.1 candidate blocks", self.candidate_block_buffer)
        stock(self, hidden_states, index_q, *args)
        if self.indexer is not None:
            checker.write(layer, self.topk_indices_buffer)
            writes = self.layer_id == self.candidate_source_layer and index_q is not None
            if writes and self.candidate_block_buffer is not None:
                checker.write(layer, self.candidate_block_buffer)

    return _sparse_indexer_and_attn


def apply(target: ModuleType) -> None:
    layer = target.DeepseekV4Attention
    layer._sparse_indexer_and_attn = checked_v41_layer(
        isolation.CHECKER, layer._sparse_indexer_and_attn
    )
