"""Per-DBO-microbatch copies of the DSA shared top-k hand-off.

A leader layer writes the logical top-k and its group converts it to physical
top-k once; follower layers read both later. Under dual batch overlap the two
microbatches interleave between a leader and its followers, so every
microbatch after the first needs its own copy of that state. This module holds
the new types and lookups only; it patches nothing and is written to drop into
`vllm/v1/attention/backends/mla/index_group.py` as is.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling

from vllm.utils.torch_utils import _resolve_layer_name
from vllm.v1.worker import ubatching

# DBO registers each microbatch thread here (and only mutates the dict); the
# index_group patch checks that at registration, and stays out if it moved.
_UBATCH_ID_OF_THREAD: dict[int, int] = getattr(ubatching, "_THREAD_ID_TO_CONTEXT", {})


def current_ubatch_id() -> int:
    """DBO microbatch of the calling thread; 0 for any other thread.

    `dbo_current_ubatch_id()` raises KeyError for a thread that is not a
    microbatch thread while microbatches run; a state lookup must not.
    """
    if not _UBATCH_ID_OF_THREAD:
        return 0
    return _UBATCH_ID_OF_THREAD.get(threading.get_ident(), 0)


@dataclass
class UbatchTopkState:
    """One extra microbatch's copy of a follower-bearing group's top-k state."""

    physical_topk_indices: torch.Tensor
    valid_topk_counts: torch.Tensor
    logical_topk_ready: torch.Event
    physical_topk_ready: torch.Event


UBATCH_TOPK_FIELDS = tuple(f.name for f in fields(UbatchTopkState))


class UbatchTopkField:
    """Group attribute that resolves to the calling microbatch's copy.

    Microbatch 0 keeps the value the group was built with, so runs without DBO
    and groups without followers see exactly the stock attribute. Every read
    of the state, in vLLM's `_convert_once` and `set_logical_topk_ready` or
    anywhere else, resolves here: nothing depends on where DBO yields.
    Code that torch.compile traces (a compiled model records the logical-ready
    event from its forward) sees microbatch 0's value: a traced graph cannot
    choose per microbatch, and Dynamo cannot trace the thread lookup.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # Microbatch 0's value lives under its own name: Dynamo reads
        # `group.__dict__[name]` back through this descriptor.
        self.slot = f"_{name}_ubatch0"

    def __get__(self, group: Any, owner: type | None = None) -> Any:
        if group is None:
            return self
        # `topk_state`, inline: read several times per sparse MLA call.
        if _UBATCH_ID_OF_THREAD and not is_dynamo_compiling():
            ubatch_id = _UBATCH_ID_OF_THREAD.get(threading.get_ident(), 0)
            if ubatch_id and group.ubatch_topk_states:
                return getattr(group.ubatch_topk_states[ubatch_id - 1], self.name)
        return group.__dict__[self.slot]

    def __set__(self, group: Any, value: Any) -> None:
        state = group._topk_state()
        if state is group:
            group.__dict__[self.slot] = value
        else:
            setattr(state, self.name, value)


def topk_state(group: Any) -> Any:
    """The group itself for microbatch 0, else that microbatch's extra copy.

    Groups without followers have no extra copies: they write and read their
    top-k within one layer, with no yield in between.
    """
    ubatch_id = current_ubatch_id()
    if ubatch_id == 0 or not group.ubatch_topk_states:
        return group
    return group.ubatch_topk_states[ubatch_id - 1]


def resolve_logical_topk(
    group: Any, buffer: torch.Tensor | None
) -> torch.Tensor | None:
    """The calling microbatch's logical top-k buffer in place of `buffer`.

    Only the builder's own logical buffer has microbatch copies; a buffer
    re-pointed elsewhere (the MTP draft's) resolves to itself. So does the
    buffer of a group whose leader writes the top-k without asking the impl
    (its writers would fill microbatch 0's buffer for every microbatch).
    """
    if not _UBATCH_ID_OF_THREAD:
        return buffer
    ubatch_id = _UBATCH_ID_OF_THREAD.get(threading.get_ident(), 0)
    if ubatch_id == 0 or group is None:
        return buffer
    extra = group.ubatch_logical_topk_indices
    if not extra or not group.leader_writes_follow_impl or buffer is not group.logical_topk_indices:
        return buffer
    return extra[ubatch_id - 1]


# Leaders whose logical top-k `torch.ops.vllm.sparse_attn_indexer` writes from
# a torch.compile'd model, by the indexer's k-cache layer name: all the op body
# sees of its caller.
INDEXER_OP_LEADERS: dict[str, Any] = {}
# The op body's parameters `per_ubatch_indexer_kernel` reads and replaces.
INDEXER_KERNEL_PARAMETERS = ("k_cache_prefix", "topk_indices_buffer")


def wire_indexer_op_leader(k_cache_prefix: str, group: Any) -> None:
    """Let the indexer op of the leader at `k_cache_prefix` write through `group`."""
    INDEXER_OP_LEADERS[k_cache_prefix] = group
    group.leader_writes_follow_impl = True


def per_ubatch_indexer_kernel(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`kernel`, the body of vLLM's sparse_attn_indexer op, writing the calling
    microbatch's logical top-k for the leaders in `INDEXER_OP_LEADERS`.

    A compiled model hands the op the buffer it was traced with, so only the
    op body, which runs in the microbatch's thread (eagerly, at CUDA-graph
    capture, and at piecewise replay), can choose. The buffer arrives as a
    graph input, so it is matched by address, not identity.
    """
    names = list(inspect.signature(kernel).parameters)
    prefix_at, buffer_at = (names.index(name) for name in INDEXER_KERNEL_PARAMETERS)

    def argument(args: tuple, kwargs: dict, at: int) -> Any:
        return args[at] if len(args) > at else kwargs[names[at]]

    @functools.wraps(kernel)
    def per_ubatch_kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _UBATCH_ID_OF_THREAD and INDEXER_OP_LEADERS:
            group = INDEXER_OP_LEADERS.get(_resolve_layer_name(argument(args, kwargs, prefix_at)))
            buffer = argument(args, kwargs, buffer_at)
            if group is not None and _same_tensor(buffer, group.logical_topk_indices):
                resolved = resolve_logical_topk(group, group.logical_topk_indices)
                if len(args) > buffer_at:
                    args = (*args[:buffer_at], resolved, *args[buffer_at + 1 :])
                else:
                    kwargs = {**kwargs, names[buffer_at]: resolved}
        return kernel(*args, **kwargs)

    return per_ubatch_kernel


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape)


def share_logical_topk_ready(group: Any) -> None:
    """Every microbatch of `group` records and waits on the group's own
    logical-ready event.

    A compiled model records it from traced code
    (`MultiHeadLatentAttentionWrapper.forward`), so the graph records the
    event the tracer saw, microbatch 0's, in every microbatch; another
    microbatch's own event would never be recorded and its wait would be a
    no-op, racing the indexer. One event is enough: the microbatches share one
    compute stream, and a leader records and waits within one layer, with no
    yield in between, so the latest record always follows its own indexer.
    Call it outside microbatches (at model build).
    """
    for state in group.ubatch_topk_states:
        state.logical_topk_ready = group.logical_topk_ready


def new_ubatch_topk_state(group: Any) -> UbatchTopkState:
    """Buffers shaped like microbatch 0's; events like the group's own."""
    return UbatchTopkState(
        physical_topk_indices=torch.empty_like(group.physical_topk_indices),
        valid_topk_counts=torch.empty_like(group.valid_topk_counts),
        logical_topk_ready=torch.Event(),
        physical_topk_ready=torch.Event(),
    )


def add_follower_state(builder: Any, group: Any) -> None:
    """Allocate the extra microbatches' state when `group` gets a follower.

    Once per builder this also allocates the extra logical buffers, into the
    list every group of the builder already holds by reference.
    """
    num_extra = builder.num_ubatches - 1
    group.ubatch_topk_states = [new_ubatch_topk_state(group) for _ in range(num_extra)]
    builder.follower_groups.append(group)
    if not builder.ubatch_logical_topk_indices:
        builder.ubatch_logical_topk_indices.extend(
            new_ubatch_logical_topk(builder.logical_topk_indices, num_extra)
        )


def new_ubatch_logical_topk(buffer: torch.Tensor, num_extra: int) -> list[torch.Tensor]:
    """One logical buffer shaped like microbatch 0's per extra microbatch."""
    return [torch.empty_like(buffer) for _ in range(num_extra)]


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


def share_ubatch_logical_topk(groups: list[Any], leaders: list[tuple[Any, Any]]) -> None:
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
    if all(g.has_indexer for g in groups) or any(g.logical_topk_indices is not buffer for g in groups):
        return
    if not all(hasattr(op, "index_group") for op, _ in leaders):
        return
    extra = new_ubatch_logical_topk(buffer, groups[0].num_ubatches - 1)
    for group in groups:
        group.ubatch_logical_topk_indices = extra
        group.leader_writes_follow_impl = True
    for op, group in leaders:
        op.index_group = group


def index_groups(model: torch.nn.Module) -> list[Any]:
    """The distinct index groups of a model's sparse MLA impls."""
    groups: dict[int, Any] = {}
    for module in model.modules():
        group = getattr(getattr(module, "impl", None), "index_group", None)
        if group is not None:
            groups.setdefault(id(group), group)
    return list(groups.values())


def reads_another_layers_topk(group: Any) -> bool:
    """A group with followers, or a follower's group of its own."""
    return group.num_layers > 1 or not group.has_indexer


def followed_groups(groups: list[Any]) -> list[Any]:
    """The groups that read another layer's top-k and have microbatch copies
    (a group with followers, or a single-layer follower group of HYV4 / ROCm DSA)."""
    return [g for g in groups if g.ubatch_logical_topk_indices and reads_another_layers_topk(g)]


def shares_topk_across_ubatches(group: Any) -> bool:
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
    copied = group.ubatch_topk_states if group.num_layers > 1 else group.ubatch_logical_topk_indices
    return not (copied and group.leader_writes_follow_impl)


def ubatch_topk_bytes(groups: list[Any]) -> int:
    """Bytes allocated for extra microbatches across `groups`."""
    logical = {id(g.ubatch_logical_topk_indices): g.ubatch_logical_topk_indices for g in groups}
    tensors = [t for extra in logical.values() for t in extra]
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
    """Extra bytes per GPU per extra microbatch, as `add_follower_state` allocates.

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
