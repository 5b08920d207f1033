"""Patch of `vllm.model_executor.layers.sparse_attn_indexer`."""

from __future__ import annotations

from collections.abc import Callable
from types import CellType, ModuleType

from vllm_dsa_dbo.patches import Patch
from vllm_dsa_dbo.ubatch_topk import per_ubatch_indexer_kernel

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


def closure_cell(fn: Callable, name: str) -> CellType:
    """The cell holding `fn`'s free variable `name`."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)]


def apply(target: ModuleType) -> None:
    cell = closure_cell(target.sparse_attn_indexer, "fn")
    cell.cell_contents = per_ubatch_indexer_kernel(cell.cell_contents)
