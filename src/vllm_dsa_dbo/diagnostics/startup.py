"""The startup line a worker logs for a model the fix allocated state for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_dsa_dbo.core import extra_topk_states
from vllm_dsa_dbo.diagnostics.refusals import (
    followed_groups,
    index_groups,
    keeps_logical_per_ubatch,
    sparse_mla_backend,
    ubatch_count,
)
from vllm_dsa_dbo.ubatch_buffers import stored_buffer, ubatch_copies

if TYPE_CHECKING:
    import torch
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup


def ubatch_topk_bytes(groups: list[SparseMLAIndexGroup]) -> int:
    """Bytes allocated for extra microbatches across `groups`: their valid counts, once each,
    less microbatch 0's (they read its top-k rows from their token offset)."""
    ubatch0 = {_storage(g.valid_topk_counts) for g in groups}
    extra = {
        _storage(state.valid_topk_counts): state.valid_topk_counts
        for group in groups
        for state in extra_topk_states(group)
    }
    return sum(t.untyped_storage().nbytes() for key, t in extra.items() if key not in ubatch0)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


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
    kept = [g for g in index_groups(model) if keeps_logical_per_ubatch(g)]
    if kept:
        allocated = ubatch_topk_bytes(kept)
        kept_ids = {id(g) for g in kept}
        backends = sorted(
            {
                sparse_mla_backend(m)
                for m in model.modules()
                if id(getattr(getattr(m, "impl", None), "index_group", None)) in kept_ids
            }
        )
        return (
            f"vllm-dsa-dbo: {name} keeps shared top-k per DBO microbatch: "
            f"{ubatch_count(kept[0])} microbatches, "
            f"{len(followed_groups(kept))} index groups with followers, {allocated:,} bytes "
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
