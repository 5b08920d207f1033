"""Patch of `vllm.model_executor.model_loader.base_loader`."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dsa_dbo.patches import Patch
from vllm_dsa_dbo.ubatch_topk import (
    index_groups,
    shares_topk_across_ubatches,
    ubatch_topk_bytes,
)

PATCH = Patch(
    target="vllm.model_executor.model_loader.base_loader",
    why=(
        "An operator cannot see from the logs whether the fix is active for a model "
        "or what it costs; and models whose leaders write the top-k outside "
        "DeepseekV32Attention (the deepseek_v2 / glm4_moe_lite DSA path), or whose "
        "followers build private index groups (ROCm DSA, HYV4), would still share "
        "it between microbatches."
    ),
    how=(
        "Wraps the loader's initialize_model: after a model is built, each worker "
        "refuses, under DBO, a model whose followers would read shared top-k "
        "state (leaders not wired to the per-microbatch buffers, or followers in "
        "private groups), else logs one INFO line with the microbatch "
        "count, the index groups with followers and the bytes allocated, and "
        "nothing when nothing was allocated."
    ),
    upstream=(
        "none for the log line; the refusal stands in for the deepseek_v2 path, "
        "which PR #60734 leaves unfixed"
    ),
    remove_when="with the other patches (the vLLM release that merges PR #60734)",
)


def check_wired(model: Any) -> None:
    """Refuse DBO for a model whose leaders write the shared top-k elsewhere."""
    if any(shares_topk_across_ubatches(g) for g in index_groups(model)):
        raise ValueError(
            f"vllm-dsa-dbo: {type(model).__name__} shares top-k between layers "
            "(index_topk_freq > 1 or an index_topk_pattern), but on this code path "
            "its leader layers write the top-k without going through the "
            "per-microbatch buffers (only vLLM's CUDA DeepSeek-V3.2 / GLM-5 "
            "path, vllm/models/deepseek_v32/nvidia, is covered). With dual batch "
            "overlap its followers would read the other microbatch's top-k. "
            "Drop --enable-dbo (and --ubatch-size) for this model."
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
        check_wired(model)
        line = describe(model)
        if line is not None:
            logger.info(line)
        return model

    target.initialize_model = initialize_model
