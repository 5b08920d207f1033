"""The startup line a worker logs for a model the fix allocated state for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_dsa_dbo.core import extra_topk_states
from vllm_dsa_dbo.diagnostics.refusals import (
    extra_logical_topk,
    followed_groups,
    has_logical_copies,
    index_groups,
    sparse_mla_backend,
    ubatch_count,
)
from vllm_dsa_dbo.ubatch_buffers import stored_buffer, ubatch_copies

if TYPE_CHECKING:
    import torch
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup


def ubatch_topk_bytes(groups: list[SparseMLAIndexGroup]) -> int:
    """Bytes allocated for extra microbatches across `groups`: their tensors, once each, less
    microbatch 0's that they share (layout "offsets" reads those at a token offset)."""
    ubatch0 = {
        id(t)
        for g in groups
        for t in (g.logical_topk_indices, g.physical_topk_indices, g.valid_topk_counts)
    }
    extra = {id(t): t for g in groups for t in extra_logical_topk(g)}
    for group in groups:
        for state in extra_topk_states(group):
            # A vLLM carrying the upstream change keeps no physical rows per microbatch.
            for t in (getattr(state, "physical_topk_indices", None), state.valid_topk_counts):
                if t is not None:
                    extra[id(t)] = t
    return _bytes([t for key, t in extra.items() if key not in ubatch0])


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copied_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers with per-microbatch copies that layers of `model` hold, once each
    (DeepSeek-V4.1's top-k and candidate blocks)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name in ("topk_indices_buffer", "candidate_block_buffer"):
            buffer = stored_buffer(module, name)
            if ubatch_copies(buffer):
                found[id(buffer)] = buffer
    return list(found.values())


def describe(model: Any) -> str | None:
    """The startup line for `model`, or None when the fix allocated nothing."""
    name = type(model).__name__
    copied = [g for g in index_groups(model) if has_logical_copies(g)]
    if copied:
        allocated = ubatch_topk_bytes(copied)
        copied_ids = {id(g) for g in copied}
        backends = sorted(
            {
                sparse_mla_backend(m)
                for m in model.modules()
                if id(getattr(getattr(m, "impl", None), "index_group", None)) in copied_ids
            }
        )
        return (
            f"vllm-dsa-dbo: {name} keeps shared top-k per DBO microbatch: "
            f"{ubatch_count(copied[0])} microbatches, "
            f"{len(followed_groups(copied))} index groups with followers, {allocated:,} bytes "
            f"({allocated / 2**20:.1f} MiB) allocated; sparse MLA backend {', '.join(backends)}"
        )
    buffers = copied_buffers(model)
    if not buffers:
        return None
    allocated = _bytes([c for b in buffers for c in ubatch_copies(b)])
    return (
        f"vllm-dsa-dbo: {name} keeps DeepSeek-V4.1 index state per DBO "
        f"microbatch: {len(ubatch_copies(buffers[0])) + 1} microbatches, {len(buffers)} "
        f"handed-off buffers, {allocated:,} bytes ({allocated / 2**20:.1f} MiB) allocated"
    )
