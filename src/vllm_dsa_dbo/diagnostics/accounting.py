"""Bytes the fix allocates: measured on built groups, and by formula for `memory`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup


def ubatch_topk_bytes(groups: list[SparseMLAIndexGroup]) -> int:
    """Bytes allocated for extra microbatches across `groups`."""
    logical = {id(g.ubatch_logical_topk): g.ubatch_logical_topk for g in groups}
    tensors = [t for extra in logical.values() if extra is not None for t in extra.buffers]
    for group in groups:
        for state in group.ubatch_topk_states:
            tensors += [state.physical_topk_indices, state.valid_topk_counts]
    return sum(t.numel() * t.element_size() for t in tensors)


def ubatch_topk_bytes_per_extra_ubatch(
    *,
    max_num_batched_tokens: int,
    max_decode_rows: int,
    index_topk: int,
    groups_with_followers: int,
    logical_only: bool = False,
) -> int:
    """Extra bytes per GPU per extra microbatch, as `core.add_layer_state` allocates.

    One logical buffer `[max_num_batched_tokens, index_topk]` when any group
    has followers, plus per such group `max_decode_rows + 1` physical rows of
    `index_topk` and as many valid counts, all int32. `logical_only`: the
    logical buffer alone, as `share_ubatch_logical_topk` allocates for models
    whose followers build private groups (HYV4, ROCm DSA).
    """
    if groups_with_followers == 0:
        return 0
    if logical_only:
        return 4 * max_num_batched_tokens * index_topk
    rows = max_decode_rows + 1
    index_bytes = (max_num_batched_tokens + groups_with_followers * rows) * index_topk
    return 4 * (index_bytes + groups_with_followers * rows)
