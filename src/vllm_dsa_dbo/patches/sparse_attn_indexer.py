"""Patch of `vllm.model_executor.layers.sparse_attn_indexer`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import CellType, ModuleType
from typing import Any

import torch
from vllm.utils.torch_utils import _resolve_layer_name

from vllm_dsa_dbo.core import INDEXER_OP_LEADERS, current_ubatch_id, resolve_logical_topk
from vllm_dsa_dbo.patches._shared import Patch

# The op body's parameters `per_ubatch_indexer_kernel` reads and replaces.
INDEXER_KERNEL_PARAMETERS = ("k_cache_prefix", "topk_indices_buffer")


def per_ubatch_indexer_kernel(
    kernel: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
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
        if INDEXER_OP_LEADERS and current_ubatch_id():
            prefix = _resolve_layer_name(argument(args, kwargs, prefix_at))
            group = INDEXER_OP_LEADERS.get(prefix)
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


def closure_cell(fn: Callable, name: str) -> CellType:
    """The cell holding `fn`'s free variable `name`."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)]


def check(target: ModuleType) -> str | None:
    """The registered op body wraps the module's own kernel in a cell `fn`,
    and the kernel takes the parameters per_ubatch_indexer_kernel looks up."""
    op_body = target.sparse_attn_indexer
    if "fn" not in getattr(getattr(op_body, "__code__", None), "co_freevars", ()):
        return "sparse_attn_indexer is no longer a wrapper with a closure cell 'fn'"
    kernel = closure_cell(op_body, "fn").cell_contents
    if kernel is not getattr(op_body, "__wrapped__", None):
        return f"sparse_attn_indexer's cell 'fn' holds {kernel!r}, not the kernel it wraps"
    parameters = inspect.signature(kernel).parameters
    missing = [p for p in INDEXER_KERNEL_PARAMETERS if p not in parameters]
    if missing:
        return f"the sparse_attn_indexer kernel takes no {', '.join(missing)}"
    return None


def apply(target: ModuleType) -> None:
    cell = closure_cell(target.sparse_attn_indexer, "fn")
    cell.cell_contents = per_ubatch_indexer_kernel(cell.cell_contents)


PATCH = Patch(
    name="sparse_attn_indexer",
    fits={"0.33.0": "ba1f34f27484150e", "0.34.0": "e31ff9e7d09ca1b1"},
    differs=(
        "vLLM 0.34.0: the kernel also takes logits_dtype and dcp_direct_topk_max_rows, "
        "gathers ShardQ rows and no longer shards prefill rows by TP; the two parameters "
        "the patch maps are unchanged"
    ),
    target="vllm.model_executor.layers.sparse_attn_indexer",
    replaces=("sparse_attn_indexer",),
    why=(
        "In the torch.compile'd deepseek_v2 / glm4_moe_lite DSA path the leader's "
        "SparseAttnIndexer hands torch.ops.vllm.sparse_attn_indexer the model-wide "
        "logical top-k buffer, fixed when the graph was traced: no Python around "
        "the op can pick a microbatch's rows."
    ),
    how=(
        "The op's registered callable is vLLM's eager_break_during_capture "
        "wrapper; its closure cell fn now holds per_ubatch_indexer_kernel(fn), "
        "which maps the buffer (by address) to the calling microbatch's rows for "
        "leaders wired by the mla patch, and passes every other call through."
    ),
    upstream=(
        "none yet: PR #60734 covers the eager deepseek_v32 path only; in tree this "
        "is the buffer choice at the top of sparse_attn_indexer()"
    ),
    remove_when="a vLLM release that keeps the compiled DSA path's top-k per microbatch",
    requires=("index_group", "sparse_mla_attention"),
    apply=apply,
    check=check,
)
