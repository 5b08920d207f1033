"""Shared top-k state kept per DBO microbatch: its types, its lookup by the calling
microbatch, its allocation; patches nothing.

A leader layer writes the logical top-k and its index group converts it to physical
top-k once; follower layers read both later. DBO interleaves the microbatches between
a leader and its followers, so every microbatch after the first needs state of its own:
it reads and writes microbatch 0's buffers from its first row in the whole batch
(`dbo_current_ubatch_token_offset()`, as vLLM's routed-experts capturer does), and keeps
its own ready events and valid counts. Only those counts are allocated.

The upstream change has the same parts in vLLM's shape (docs/UPSTREAM.md):
`topk_state` is `SparseMLAIndexGroup._topk_state()`, `resolve_logical_topk` is
`ubatch_topk_rows()`, `init_builder_state` / `add_layer_state` are the
builder's `__init__(..., num_ubatches)` / `_add_ubatch_topk`.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_dynamo_compiling
from vllm.v1.worker import ubatching
from vllm.v1.worker.ubatching import dbo_current_ubatch_token_offset

from vllm_dsa_dbo import carried

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.index_group import (
        SparseMLAIndexGroup,
        SparseMLAIndexGroupBuilder,
    )

# DBO registers each microbatch thread here (and only mutates the dict); the
# index_group patch checks that at registration, and stays out if it moved. Read only
# by `current_ubatch_id`.
_UBATCH_ID_OF_THREAD: dict[int, int] = getattr(ubatching, "_THREAD_ID_TO_CONTEXT", {})


def configured_num_ubatches() -> int:
    """The microbatch count of the config vLLM is building a model for (1 outside one)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.worker.ubatch_utils import get_num_ubatches

    config = get_current_vllm_config_or_none()
    return 1 if config is None else get_num_ubatches(config.parallel_config)


def current_ubatch_id() -> int:
    """DBO microbatch of the calling thread, 0 for any other (vLLM's own lookup raises) and in
    code torch.compile traces, which cannot trace the lookup."""
    if not _UBATCH_ID_OF_THREAD or is_dynamo_compiling():
        return 0
    return _UBATCH_ID_OF_THREAD.get(threading.get_ident(), 0)


@dataclass
class UbatchTopkState:
    """One extra microbatch's converted top-k state: microbatch 0's rows from its token
    offset on, and its own counts and events. The counts are not shared: from an odd row
    they would be only 4-byte aligned for the kernels that read them."""

    rows: torch.Tensor
    valid_topk_counts: torch.Tensor
    logical_topk_ready: torch.Event
    physical_topk_ready: torch.Event

    @property
    def physical_topk_indices(self) -> torch.Tensor:
        offset = dbo_current_ubatch_token_offset()
        return self.rows[offset:] if offset else self.rows

    @classmethod
    def like(cls, group: SparseMLAIndexGroup) -> UbatchTopkState:
        """Microbatch 0's rows; counts shaped like its own; events like the group's."""
        return cls(
            rows=group.physical_topk_indices,
            valid_topk_counts=torch.empty_like(group.valid_topk_counts),
            logical_topk_ready=torch.Event(),
            physical_topk_ready=torch.Event(),
        )


UBATCH_TOPK_FIELDS = (
    "physical_topk_indices",
    "valid_topk_counts",
    "logical_topk_ready",
    "physical_topk_ready",
)


@dataclass(eq=False)
class UbatchLogicalTopk:
    """The logical top-k buffer one builder's groups share, which microbatches 1.. read and
    write from their token offset once a group has followers (`followed`)."""

    buffer: torch.Tensor
    num_ubatches: int
    followed: bool = False

    def ubatch_rows(self) -> torch.Tensor:
        """The calling microbatch's rows: the buffer from its token offset."""
        # Rows past a microbatch's own are written only in DBO's order: the indexer's padded
        # decode path (and ROCm's sparse path) fills `[:num_padded_tokens]`, so microbatch k's
        # padding lands in microbatch k+1's rows. That is harmless because DBO's yields never
        # let microbatch k run its next leader before microbatch k+1's followers of the
        # previous leader have read: every layer from the first MoE one yields, and the dense
        # layers before it run before microbatch k+1 starts.
        return self.buffer[dbo_current_ubatch_token_offset() :]


def topk_state(
    group: SparseMLAIndexGroup,
) -> SparseMLAIndexGroup | UbatchTopkState:
    """The group itself for microbatch 0, else that microbatch's extra state (groups without
    followers have none: they write and read within one layer, with no yield between)."""
    ubatch_id = current_ubatch_id()
    if ubatch_id == 0 or not group.ubatch_topk_states:
        return group
    return group.ubatch_topk_states[ubatch_id - 1]


def extra_topk_states(group: Any) -> list[Any]:
    """`group`'s converted top-k states for microbatches 1..: the plugin's, or those of a vLLM
    carrying the upstream change (`ubatch_topk`, microbatch 0's first)."""
    if carried.own_groups():
        return list(group.ubatch_topk)[1:]
    return list(getattr(group, "ubatch_topk_states", ()))


class UbatchTopkField:
    """Group attribute resolving to the calling microbatch's state, so vLLM's methods reading
    it run unchanged; traced code sees microbatch 0's (Dynamo cannot trace the lookup)."""

    def __init__(self, name: str) -> None:
        self.name = name
        # Microbatch 0's value lives under its own name: Dynamo reads
        # `group.__dict__[name]` back through this descriptor.
        self.slot = f"_{name}_ubatch0"

    def __get__(self, group: SparseMLAIndexGroup | None, owner: type | None = None) -> Any:
        if group is None:
            return self
        ubatch_id = current_ubatch_id()
        if ubatch_id and group.ubatch_topk_states:
            return getattr(group.ubatch_topk_states[ubatch_id - 1], self.name)
        try:
            return group.__dict__[self.slot]
        except KeyError:  # unset (a group built without __init__): as a plain field
            raise AttributeError(
                f"{type(group).__name__!r} object has no attribute {self.name!r}"
            ) from None

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

    A buffer re-pointed elsewhere (the MTP draft's) resolves to itself, and so does that
    of a group whose leader's writers do not ask the impl (they would fill microbatch 0's).
    The group's buffers are the plugin's or those of a vLLM carrying the upstream change.
    """
    ubatch_id = current_ubatch_id()
    if ubatch_id == 0 or not getattr(group, "leader_writes_follow_impl", False):
        return buffer
    if carried.own_groups():  # vLLM's own: its rows at the token offset
        return group.ubatch_topk_rows(buffer) if buffer is group.logical_topk_indices else buffer
    extra = group.ubatch_logical_topk
    if not extra.followed or buffer is not extra.buffer:
        return buffer
    return extra.ubatch_rows()


def init_builder_state(builder: SparseMLAIndexGroupBuilder, num_ubatches: int) -> None:
    """The builder's microbatch count and the logical buffers it will share."""
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    builder.num_ubatches = num_ubatches
    builder.ubatch_logical_topk = UbatchLogicalTopk(builder.logical_topk_indices, num_ubatches)


def add_layer_state(
    builder: SparseMLAIndexGroupBuilder, group: SparseMLAIndexGroup, layer_index: int
) -> None:
    """Give `group`, just registered at `layer_index`, what its microbatches need: their
    state, and the logical buffer per microbatch, at its first follower with several."""
    if layer_index == 0:
        group.num_ubatches = builder.num_ubatches
        group.ubatch_logical_topk = builder.ubatch_logical_topk
    elif layer_index == 1 and builder.num_ubatches > 1:
        builder.ubatch_logical_topk.followed = True
        group.ubatch_topk_states = tuple(
            UbatchTopkState.like(group) for _ in range(builder.num_ubatches - 1)
        )


def thread_registry_mismatch() -> str | None:
    """None when the registry the state lookups read is the one DBO's
    microbatch threads write, else what differs (every lookup would be 0)."""
    registry = getattr(ubatching, "_THREAD_ID_TO_CONTEXT", None)
    if registry is not _UBATCH_ID_OF_THREAD or not isinstance(registry, dict):
        return "vllm.v1.worker.ubatching._THREAD_ID_TO_CONTEXT is not the dict it was at import"
    enter = inspect.unwrap(ubatching.UBatchContext.__enter__)
    if "_THREAD_ID_TO_CONTEXT" not in enter.__code__.co_names:
        return "UBatchContext.__enter__ no longer registers its thread in _THREAD_ID_TO_CONTEXT"
    if registry:  # microbatches running: nothing to probe with
        return None
    registry[threading.get_ident()] = 1
    try:
        seen = ubatching.dbo_current_ubatch_id(), current_ubatch_id()
    finally:
        registry.pop(threading.get_ident(), None)
    if seen != (1, 1):
        return f"a thread registered as microbatch 1 reads (vLLM, plugin) = {seen}"
    return None


# Models whose layers build private index groups (HYV4, ROCm DSA) --------------------


def per_ubatch_indexer_op(indexer_op_cls: type) -> type:
    """`indexer_op_cls` writing the calling microbatch's logical top-k once
    `share_ubatch_logical_topk` gave it its group (unwired models, MTP drafts: vLLM's)."""

    class IndexerOp(indexer_op_cls):
        index_group = None

        @property
        def topk_indices_buffer(self) -> Any:
            return resolve_logical_topk(self.index_group, self._topk_indices_buffer)

        @topk_indices_buffer.setter
        def topk_indices_buffer(self, buffer: Any) -> None:
            self._topk_indices_buffer = buffer

    IndexerOp.__name__ = IndexerOp.__qualname__ = indexer_op_cls.__name__
    return IndexerOp


def share_ubatch_logical_topk(
    groups: list[SparseMLAIndexGroup | None], leaders: list[tuple[Any, SparseMLAIndexGroup]]
) -> None:
    """Per-microbatch logical top-k for a model whose layers build private groups.

    `groups`: every sparse layer's; `leaders`: each leader's (indexer op, group). Such
    groups convert and read their physical top-k within one layer: only the logical
    buffer is resolved per microbatch. Wires nothing (and the loader refuses the model under DBO)
    unless several microbatches run, some layer reuses another's top-k, all groups share
    one buffer and every leader's op resolves through its group.
    """
    num_ubatches = configured_num_ubatches()
    if not groups or any(g is None for g in groups) or num_ubatches < 2:
        return
    buffer = groups[0].logical_topk_indices
    if all(g.has_indexer for g in groups):
        return
    if any(g.logical_topk_indices is not buffer for g in groups):
        return
    if not all(hasattr(op, "index_group") for op, _ in leaders):
        return
    extra = UbatchLogicalTopk(buffer, num_ubatches, followed=True)
    for group in groups:
        group.ubatch_logical_topk = extra
        group.leader_writes_follow_impl = True
        if carried.own_groups():
            tree_ubatch_topk(group, num_ubatches)
    for op, group in leaders:
        op.index_group = group


def tree_ubatch_topk(group: SparseMLAIndexGroup, num_ubatches: int) -> None:
    """Give a private group of a vLLM carrying the upstream change that vLLM's per-microbatch
    state, so that its own getter resolves the calling microbatch's rows: the group's own
    counts and events for every microbatch, as such a group converts and reads its top-k
    within one layer, with no yield in between."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAUbatchTopk

    own = SparseMLAUbatchTopk(
        group.valid_topk_counts, group.logical_topk_ready, group.physical_topk_ready
    )
    group.ubatch_topk = (own,) * num_ubatches


# Leaders whose logical top-k `torch.ops.vllm.sparse_attn_indexer` writes from a
# torch.compile'd model (the mla patch wires them, the sparse_attn_indexer patch reads
# them), by the indexer's k-cache layer name: all the op body sees of its caller.
INDEXER_OP_LEADERS: dict[str, SparseMLAIndexGroup] = {}


def wire_indexer_op_leader(k_cache_prefix: str, group: SparseMLAIndexGroup) -> None:
    """Let the indexer op of the leader at `k_cache_prefix` write through `group`."""
    INDEXER_OP_LEADERS[k_cache_prefix] = group
    group.leader_writes_follow_impl = True
