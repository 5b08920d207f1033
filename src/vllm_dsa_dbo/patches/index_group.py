"""Patch of `vllm.v1.attention.backends.mla.index_group`."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any

from vllm_dsa_dbo import core
from vllm_dsa_dbo.patches._shared import Patch
from vllm_dsa_dbo.settings import NO_HISPARSE, refusal


def check(target: ModuleType) -> str | None:
    return core.thread_registry_mismatch() or builder_mismatch(target.SparseMLAIndexGroupBuilder)


def builder_mismatch(builder_cls: type) -> str | None:
    """None when the builder's methods take the parameters the patch passes."""
    expected = {
        "__init__": ["self", "logical_topk_indices", "max_decode_rows"],
        "register_layer": ["self", "is_index_producing_layer", "vllm_config"],
    }
    for method, names in expected.items():
        found = list(inspect.signature(getattr(builder_cls, method)).parameters)
        if found[: len(names)] != names:
            return f"SparseMLAIndexGroupBuilder.{method} takes {found}, expected {names} first"
    return None


def apply(target: ModuleType) -> None:
    group_cls = target.SparseMLAIndexGroup
    builder_cls = target.SparseMLAIndexGroupBuilder
    hisparse_cls = target.HiSparseMLAIndexGroup
    stock_init = builder_cls.__init__
    stock_register_layer = builder_cls.register_layer

    group_cls.ubatch_topk_states = ()
    group_cls.ubatch_logical_topk = None
    # Set by a leader's attention module that takes its buffer from the impl.
    group_cls.leader_writes_follow_impl = False
    group_cls.num_ubatches = 1
    group_cls._topk_state = core.topk_state
    for name in core.UBATCH_TOPK_FIELDS:
        setattr(group_cls, name, core.UbatchTopkField(name))

    def __init__(
        self: Any,
        logical_topk_indices: Any,
        max_decode_rows: int | None = None,
        num_ubatches: int | None = None,
    ) -> None:
        stock_init(self, logical_topk_indices, max_decode_rows)
        core.init_builder_state(
            self, core.configured_num_ubatches() if num_ubatches is None else num_ubatches
        )

    def register_layer(
        self: Any, is_index_producing_layer: bool, vllm_config: Any = None, **kwargs: Any
    ) -> tuple[Any, int]:
        joins_as_follower = not is_index_producing_layer and self.current_group is not None
        if (
            joins_as_follower
            and self.num_ubatches > 1
            and isinstance(self.current_group, hisparse_cls)
        ):
            raise refusal(
                "HiSparse cannot run with dual batch overlap on a model with shared "
                "top-k layers (index_topk_freq > 1 or an index_topk_pattern): its "
                "top-k staging has no microbatch dimension and followers would read "
                "the other microbatch's selection.",
                NO_HISPARSE,
            )
        group, layer_index = stock_register_layer(
            self, is_index_producing_layer, vllm_config, **kwargs
        )
        core.add_layer_state(self, group, layer_index)
        return group, layer_index

    builder_cls.__init__ = __init__
    builder_cls.register_layer = register_layer


PATCH = Patch(
    name="index_group",
    fits={"0.33.0": "3d021717ba2195ea", "0.34.0": "4f590629346fd2a8"},
    differs=(
        "vLLM 0.34.0: register_layer takes row_width= for head_size=, streams come from "
        "_current_stream(), and the module's _create_event / _create_side_stream are "
        "gone; the patch passes all of it through"
    ),
    target="vllm.v1.attention.backends.mla.index_group",
    replaces=(
        "SparseMLAIndexGroup.ubatch_topk_states",
        "SparseMLAIndexGroup.ubatch_logical_topk",
        "SparseMLAIndexGroup.leader_writes_follow_impl",
        "SparseMLAIndexGroup.num_ubatches",
        "SparseMLAIndexGroup._topk_state",
        "SparseMLAIndexGroup.physical_topk_indices",
        "SparseMLAIndexGroup.valid_topk_counts",
        "SparseMLAIndexGroup.logical_topk_ready",
        "SparseMLAIndexGroup.physical_topk_ready",
        "SparseMLAIndexGroupBuilder.__init__",
        "SparseMLAIndexGroupBuilder.register_layer",
    ),
    why=(
        "SparseMLAIndexGroup holds one physical top-k, one valid-count buffer and "
        "two ready events per group; under DBO microbatch 1's leader overwrites "
        "them before microbatch 0's followers read them."
    ),
    how=(
        "SparseMLAIndexGroupBuilder takes num_ubatches (default: the current "
        "config's) and gives a group, at its first follower, a UbatchTopkState per "
        "extra microbatch: microbatch 0's rows from that microbatch's token offset, "
        "its own valid counts and events; the builder's logical buffer is read the "
        "same way. The group's four state fields resolve to the calling "
        "microbatch's state, as _topk_state() does (microbatch 0's in code "
        "torch.compile traces), so vLLM's _convert_once and set_logical_topk_ready "
        "run unchanged. HiSparse followers under DBO are refused at construction."
    ),
    upstream=(
        "vllm PR #60734: SparseMLAIndexGroupBuilder(num_ubatches=...), "
        "SparseMLAIndexGroup.ubatch_topk and _topk_state()."
    ),
    remove_when="the vLLM release that merges PR #60734 (not in 0.33.0)",
    apply=apply,
    check=check,
)
