"""Patch of `vllm.model_executor.model_loader.base_loader`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.patches import Patch
from vllm_dsa_dbo.ubatch_topk import index_groups, ubatch_topk_bytes

PATCH = Patch(
    target="vllm.model_executor.model_loader.base_loader",
    why=(
        "An operator cannot see from the logs whether the fix is active for a model "
        "or what it costs."
    ),
    how=(
        "Wraps the loader's initialize_model: after a model is built, each worker "
        "logs one INFO line with the microbatch count, the index groups with "
        "followers and the bytes allocated, and nothing when nothing was allocated."
    ),
    upstream="none: operator visibility for the plugin only",
    remove_when="with the other patches (the vLLM release that merges PR #60734)",
)


def describe(model: Any) -> str | None:
    """The startup line for `model`, or None when the fix allocated nothing."""
    followed = [g for g in index_groups(model) if g.ubatch_topk_states]
    if not followed:
        return None
    allocated = ubatch_topk_bytes(followed)
    return (
        f"vllm-dsa-dbo: {type(model).__name__} keeps shared top-k per DBO microbatch: "
        f"{len(followed[0].ubatch_topk_states) + 1} microbatches, {len(followed)} index "
        f"groups with followers, {allocated:,} bytes ({allocated / 2**20:.1f} MiB) allocated"
    )


def apply(target: ModuleType) -> None:
    from vllm.logger import init_logger

    from vllm_dsa_dbo import LOGGER_NAME

    logger = init_logger(LOGGER_NAME)
    stock = target.initialize_model

    def initialize_model(*args: Any, **kwargs: Any) -> Any:
        model = stock(*args, **kwargs)
        line = describe(model)
        if line is not None:
            logger.info(line)
        return model

    target.initialize_model = initialize_model
