"""Indexer-op wiring, model walks and byte accounting around `core`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from vllm.utils.torch_utils import _resolve_layer_name

from vllm_dsa_dbo.core import _UBATCH_ID_OF_THREAD, UbatchLogicalTopk, resolve_logical_topk

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
    extra = UbatchLogicalTopk(buffer, groups[0].num_ubatches)
    extra.allocate()
    for group in groups:
        group.ubatch_logical_topk = extra
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
    return [g for g in groups if has_logical_copies(g) and reads_another_layers_topk(g)]


def has_logical_copies(group: Any) -> bool:
    """Whether `group` holds extra microbatches' logical buffers."""
    extra = getattr(group, "ubatch_logical_topk", None)
    return extra is not None and bool(extra.buffers)


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
    copied = group.ubatch_topk_states if group.num_layers > 1 else has_logical_copies(group)
    return not (copied and group.leader_writes_follow_impl)


def ubatch_topk_bytes(groups: list[Any]) -> int:
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
