"""Patch of `vllm.model_executor.layers.sparse_attn_indexer`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import CellType, ModuleType

from vllm_dsa_dbo.patches import Patch
from vllm_dsa_dbo.ubatch_topk import INDEXER_KERNEL_PARAMETERS, per_ubatch_indexer_kernel

PATCH = Patch(
    target="vllm.model_executor.layers.sparse_attn_indexer",
    why=(
        "In the torch.compile'd deepseek_v2 / glm4_moe_lite DSA path the leader's "
        "SparseAttnIndexer hands torch.ops.vllm.sparse_attn_indexer the model-wide "
        "logical top-k buffer, fixed when the graph was traced: no Python around "
        "the op can pick a microbatch's copy."
    ),
    how=(
        "The op's registered callable is vLLM's eager_break_during_capture "
        "wrapper; its closure cell fn now holds per_ubatch_indexer_kernel(fn), "
        "which maps the buffer (by address) to the calling microbatch's copy for "
        "leaders wired by the mla patch, and passes every other call through."
    ),
    upstream=(
        "none yet: PR #60734 covers the eager deepseek_v32 path only; in tree this "
        "is the buffer choice at the top of sparse_attn_indexer()"
    ),
    remove_when="a vLLM release that keeps the compiled DSA path's top-k per microbatch",
)


REQUIRES = ("index_group",)


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
