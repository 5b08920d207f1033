"""The startup line a worker logs for a model the fix allocated state for."""

from __future__ import annotations

from typing import Any

from vllm_dsa_dbo.diagnostics.accounting import ubatch_topk_bytes
from vllm_dsa_dbo.diagnostics.groups import followed_groups, has_logical_copies, index_groups
from vllm_dsa_dbo.diagnostics.refusals import sparse_mla_backend


def describe(model: Any) -> str | None:
    """The startup line for `model`, or None when the fix allocated nothing."""
    copied = [g for g in index_groups(model) if has_logical_copies(g)]
    if not copied:
        from vllm_dsa_dbo.patches import deepseek_v41_model

        return deepseek_v41_model.describe(model)
    followed = followed_groups(copied)
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
        f"vllm-dsa-dbo: {type(model).__name__} keeps shared top-k per DBO microbatch: "
        f"{len(copied[0].ubatch_logical_topk.buffers) + 1} microbatches, {len(followed)} index "
        f"groups with followers, {allocated:,} bytes ({allocated / 2**20:.1f} MiB) allocated; "
        f"sparse MLA backend {', '.join(backends)}"
    )
