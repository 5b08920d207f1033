"""Patch of `vllm.model_executor.layers.mla`."""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch.compiler import is_dynamo_compiling
from vllm.platforms import current_platform

from vllm_dsa_dbo import carried
from vllm_dsa_dbo.core import configured_num_ubatches, extra_topk_states, wire_indexer_op_leader
from vllm_dsa_dbo.patches._shared import Patch

if TYPE_CHECKING:
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup


def share_logical_topk_ready(group: SparseMLAIndexGroup) -> None:
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
    for state in extra_topk_states(group):
        state.logical_topk_ready = group.logical_topk_ready


def wires_leader(indexer: Any, skip_topk: bool) -> bool:
    """Whether a wrapper writes its top-k through vLLM's indexer op, which the
    sparse_attn_indexer patch resolves per microbatch. Off CUDA the op is another
    one (ROCm's aiter op): left unwired, and refused."""
    indexer_op = getattr(indexer, "indexer_op", None)
    return indexer_op is not None and not skip_topk and current_platform.is_cuda()


def count_ubatches(builder: Any) -> None:
    """Give the run's microbatch count to a builder of a vLLM carrying the upstream change,
    before its first follower joins: it keeps per-microbatch state (`_add_ubatch_topk`)
    only where the model passed the count, as its DeepseekV32Model does and deepseek_v2.py
    does not. The plugin's own builder takes the run's count already."""
    if carried.own_groups():
        builder.num_ubatches = max(builder.num_ubatches, configured_num_ubatches())


def traced_as_ubatch0(group: SparseMLAIndexGroup) -> None:
    """Traced code reads `group`'s microbatch-0 state, as from the plugin's own group.

    A vLLM carrying the upstream change looks the state up by thread in
    `set_logical_topk_ready`, which the compiled forward runs; under DBO vLLM
    compiles in a microbatch thread, where torch.compile cannot trace the lookup."""
    lookup = group._topk_state
    group._topk_state = lambda: group if is_dynamo_compiling() else lookup()


def wire(wrapper: Any) -> None:
    group = getattr(getattr(wrapper.mla_attn, "impl", None), "index_group", None)
    if group is None:
        return
    share_logical_topk_ready(group)
    if wires_leader(wrapper.indexer, wrapper.skip_topk):
        wire_indexer_op_leader(wrapper.indexer.indexer_op.k_cache.prefix, group)
        traced_as_ubatch0(group)


def apply(target: ModuleType) -> None:
    cls = target.MultiHeadLatentAttentionWrapper
    stock_init = cls.__init__
    signature = inspect.signature(stock_init)

    @functools.wraps(stock_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(self, *args, **kwargs).arguments
        modules = arguments["mla_modules"]
        if modules.index_group_builder is not None and wires_leader(
            modules.indexer, arguments.get("skip_topk", False)
        ):
            count_ubatches(modules.index_group_builder)
        stock_init(self, *args, **kwargs)
        wire(self)

    cls.__init__ = __init__


PATCH = Patch(
    name="mla",
    fits={"0.33.0": "cffe71b09e0ba928", "0.34.0": "114306e41ad02e4c"},
    differs=("vLLM 0.34.0: __init__ also takes shardq_eligible, which the hook passes through"),
    target="vllm.model_executor.layers.mla",
    replaces=("MultiHeadLatentAttentionWrapper.__init__",),
    why=(
        "MultiHeadLatentAttentionWrapper (the deepseek_v2 / glm4_moe_lite DSA "
        "layers, torch.compile'd) writes the leader's top-k through the "
        "registered indexer op and records the logical-ready event from traced "
        "code, so the event is microbatch 0's in every microbatch."
    ),
    how=(
        "After __init__, a CUDA leader's indexer op is wired to its index group "
        "(the sparse_attn_indexer patch then resolves its buffer per microbatch, "
        "as the group's impls do), and the group's extra microbatches share its "
        "logical-ready event, the one the traced graph records. On a vLLM carrying "
        "the upstream change the same wiring runs on vLLM's own per-microbatch state: "
        "before __init__, a CUDA leader hands the run's microbatch count to vLLM's "
        "builder, which deepseek_v2.py builds without it, and traced code reads the "
        "group's microbatch-0 state."
    ),
    upstream=("none yet: PR #60734 covers the eager deepseek_v32 path only"),
    remove_when="a vLLM release that keeps the compiled DSA path's top-k per microbatch",
    requires=("index_group", "sparse_mla_attention", "sparse_attn_indexer"),
    apply=apply,
)
