"""What a built model's index groups share across microbatches, and what they copy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup


def index_groups(model: torch.nn.Module) -> list[SparseMLAIndexGroup]:
    """The distinct index groups of a model's sparse MLA impls."""
    groups: dict[int, SparseMLAIndexGroup] = {}
    for module in model.modules():
        group = getattr(getattr(module, "impl", None), "index_group", None)
        if group is not None:
            groups.setdefault(id(group), group)
    return list(groups.values())


def reads_another_layers_topk(group: SparseMLAIndexGroup) -> bool:
    """A group with followers, or a follower's group of its own."""
    return group.num_layers > 1 or not group.has_indexer


def followed_groups(groups: list[SparseMLAIndexGroup]) -> list[SparseMLAIndexGroup]:
    """The groups that read another layer's top-k and have microbatch copies
    (a group with followers, or a single-layer follower group of HYV4 / ROCm DSA)."""
    return [g for g in groups if has_logical_copies(g) and reads_another_layers_topk(g)]


def has_logical_copies(group: SparseMLAIndexGroup) -> bool:
    """Whether `group` holds extra microbatches' logical buffers."""
    extra = getattr(group, "ubatch_logical_topk", None)
    return extra is not None and bool(extra.buffers)


def shares_topk_across_ubatches(group: SparseMLAIndexGroup) -> bool:
    """Whether, under DBO, a layer of `group` would read a top-k that another
    layer wrote into state the microbatches share.

    That is a group with followers, or a follower with a group of its own
    (models whose layers build private groups, like HYV4 and the ROCm DSA
    path), that runs with several microbatches and lacks per-microbatch
    copies wired to its leader's writers: the logical buffer, and for a
    group with followers also its physical state.
    """
    if group.num_ubatches < 2 or not reads_another_layers_topk(group):
        return False
    copied = group.ubatch_topk_states if group.num_layers > 1 else has_logical_copies(group)
    return not (copied and group.leader_writes_follow_impl)
