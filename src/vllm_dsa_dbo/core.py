"""Shared top-k state of sparse MLA index groups, kept per DBO microbatch.

A leader layer writes the logical top-k and its group converts it to physical
top-k once; follower layers read both later. Under dual batch overlap the
microbatches interleave between a leader and its followers, so every
microbatch after the first needs its own copy of that state. This module holds
the state type, its per-microbatch lookup and its allocation, for
`vllm/v1/attention/backends/mla/index_group.py`; it patches nothing. The
upstream change (`vllm-dsa-dbo upstream-patch`) has the same parts in vLLM's
own shape: `topk_state` is `SparseMLAIndexGroup._topk_state()`,
`resolve_logical_topk` is `ubatch_logical_topk_indices()`, and
`init_builder_state` / `add_layer_state` are `SparseMLAIndexGroupBuilder`'s
`__init__(..., num_ubatches)` / `_add_ubatch_topk`; why the shapes differ is
in docs/UPSTREAM.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_dynamo_compiling
from vllm.v1.worker import ubatching

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.index_group import (
        SparseMLAIndexGroup,
        SparseMLAIndexGroupBuilder,
    )

# DBO registers each microbatch thread here (and only mutates the dict); the
# index_group patch checks that at registration, and stays out if it moved.
_UBATCH_ID_OF_THREAD: dict[int, int] = getattr(ubatching, "_THREAD_ID_TO_CONTEXT", {})


def current_ubatch_id() -> int:
    """DBO microbatch of the calling thread; 0 for any other thread.

    `dbo_current_ubatch_id()` raises KeyError for a thread that is not a
    microbatch thread while microbatches run; a state lookup must not.
    """
    if not _UBATCH_ID_OF_THREAD:  # no microbatch running: skip the thread lookup
        return 0
    return _UBATCH_ID_OF_THREAD.get(threading.get_ident(), 0)


@dataclass
class UbatchTopkState:
    """One extra microbatch's copy of a follower-bearing group's top-k state."""

    physical_topk_indices: torch.Tensor
    valid_topk_counts: torch.Tensor
    logical_topk_ready: torch.Event
    physical_topk_ready: torch.Event

    @classmethod
    def like(cls, group: SparseMLAIndexGroup) -> UbatchTopkState:
        """Buffers shaped like microbatch 0's; events like the group's own."""
        return cls(
            physical_topk_indices=torch.empty_like(group.physical_topk_indices),
            valid_topk_counts=torch.empty_like(group.valid_topk_counts),
            logical_topk_ready=torch.Event(),
            physical_topk_ready=torch.Event(),
        )


UBATCH_TOPK_FIELDS = tuple(f.name for f in fields(UbatchTopkState))


@dataclass(eq=False)
class UbatchLogicalTopk:
    """The logical top-k buffers of microbatches 1.. that one builder's groups share.

    The builder owns it and hands it to every group it builds, leaders before
    their first follower included; `allocate` fills it once, at that follower.
    """

    buffer: torch.Tensor
    num_ubatches: int
    buffers: tuple[torch.Tensor, ...] = ()

    def allocate(self) -> None:
        """One buffer shaped like microbatch 0's per extra microbatch, once."""
        if not self.buffers:
            extra = range(self.num_ubatches - 1)
            self.buffers = tuple(torch.empty_like(self.buffer) for _ in extra)


def topk_state(group: SparseMLAIndexGroup) -> SparseMLAIndexGroup | UbatchTopkState:
    """The group itself for microbatch 0, else that microbatch's extra copy.

    Groups without followers have no extra copies: they write and read their
    top-k within one layer, with no yield in between.
    """
    ubatch_id = current_ubatch_id()
    if ubatch_id == 0 or not group.ubatch_topk_states:
        return group
    return group.ubatch_topk_states[ubatch_id - 1]


class UbatchTopkField:
    """Group attribute that resolves to the calling microbatch's copy, as
    `topk_state` does, so vLLM's methods reading it run unchanged.

    Microbatch 0 keeps the value the group was built with. Code torch.compile
    traces sees microbatch 0's: a traced graph cannot choose per microbatch,
    and Dynamo cannot trace the thread lookup.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # Microbatch 0's value lives under its own name: Dynamo reads
        # `group.__dict__[name]` back through this descriptor.
        self.slot = f"_{name}_ubatch0"

    def __get__(self, group: SparseMLAIndexGroup | None, owner: type | None = None) -> Any:
        if group is None:
            return self
        # `topk_state`, inline: read several times per sparse MLA call.
        if _UBATCH_ID_OF_THREAD and not is_dynamo_compiling():
            ubatch_id = _UBATCH_ID_OF_THREAD.get(threading.get_ident(), 0)
            if ubatch_id and group.ubatch_topk_states:
                return getattr(group.ubatch_topk_states[ubatch_id - 1], self.name)
        return group.__dict__[self.slot]

    def __set__(self, group: SparseMLAIndexGroup, value: Any) -> None:
        state = topk_state(group)
        if state is group:
            group.__dict__[self.slot] = value
        else:
            setattr(state, self.name, value)


def resolve_logical_topk(
    group: SparseMLAIndexGroup | None, buffer: torch.Tensor | None
) -> torch.Tensor | None:
    """The calling microbatch's logical top-k buffer in place of `buffer`.

    Only the builder's own logical buffer has microbatch copies; a buffer
    re-pointed elsewhere (the MTP draft's) resolves to itself. So does the
    buffer of a group whose leader writes the top-k without asking the impl
    (its writers would fill microbatch 0's buffer for every microbatch).
    """
    ubatch_id = current_ubatch_id()
    if ubatch_id == 0 or group is None or not group.leader_writes_follow_impl:
        return buffer
    extra = group.ubatch_logical_topk
    if extra is None or not extra.buffers or buffer is not extra.buffer:
        return buffer
    return extra.buffers[ubatch_id - 1]


def init_builder_state(builder: SparseMLAIndexGroupBuilder, num_ubatches: int) -> None:
    """The builder's microbatch count and the logical buffers it will share."""
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    builder.num_ubatches = num_ubatches
    builder.ubatch_logical_topk = UbatchLogicalTopk(builder.logical_topk_indices, num_ubatches)
    builder.follower_groups = []


def add_layer_state(
    builder: SparseMLAIndexGroupBuilder, group: SparseMLAIndexGroup, layer_index: int
) -> None:
    """Give `group`, just registered at `layer_index`, what its microbatches need.

    A new group gets the builder's microbatch count and logical buffers; at its
    first follower, and only with several microbatches, it gets a
    `UbatchTopkState` per extra microbatch, and the logical buffers are allocated.
    """
    if layer_index == 0:
        group.num_ubatches = builder.num_ubatches
        group.ubatch_logical_topk = builder.ubatch_logical_topk
    elif layer_index == 1 and builder.num_ubatches > 1:
        extra = range(builder.num_ubatches - 1)
        group.ubatch_topk_states = tuple(UbatchTopkState.like(group) for _ in extra)
        builder.follower_groups.append(group)
        builder.ubatch_logical_topk.allocate()
