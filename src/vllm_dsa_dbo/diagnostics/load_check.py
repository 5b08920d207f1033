"""The load-time check: each model vLLM builds is refused under DBO where its followers
would read shared top-k, else its startup line is logged."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dsa_dbo import settings
from vllm_dsa_dbo.guard import refuse_hisparse, takes_vllm_config
from vllm_dsa_dbo.patches import overridden
from vllm_dsa_dbo.patches._shared import Patch, replace_function, where

_building = threading.local()


def checked_build(build: Callable[..., Any]) -> Callable[..., Any]:
    """`build`, a vLLM function that builds a model for `vllm_config`, checking the
    model the outermost call returns (sub-models are built inside it)."""
    signature = inspect.signature(build)

    @functools.wraps(build)
    def checked(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_building, "depth", 0)
        vllm_config = signature.bind(*args, **kwargs).arguments["vllm_config"]
        if depth == 0:
            refuse_hisparse(vllm_config)
        _building.depth = depth + 1
        try:
            model = build(*args, **kwargs)
        finally:
            _building.depth = depth
        if depth == 0:
            check_model(model, vllm_config)
        return model

    return checked


def check_model(model: Any, vllm_config: Any) -> None:
    """Refuse `model` where its followers would read shared top-k under DBO, else log its line."""
    from vllm.v1.worker.ubatch_utils import get_num_ubatches

    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    for line in overridden():
        settings.logger().warning("vllm-dsa-dbo: %s, which the plugin set", line)
    check_wired(model, get_num_ubatches(vllm_config.parallel_config))
    line = describe(model)
    if line is not None:
        settings.logger().info(line)


def checked_build_end(record: Callable[..., Any]) -> Callable[..., Any]:
    """`record`, which vLLM's initialize_model calls on the model it just built, checking that
    model where no checked build is under way: another plugin put its initialize_model over
    ours after register()."""

    @functools.wraps(record)
    def record_metadata_for_reloading(model: Any, *args: Any, **kwargs: Any) -> Any:
        result = record(model, *args, **kwargs)
        if getattr(_building, "depth", 0) == 0:
            from vllm.config import get_current_vllm_config
            from vllm.model_executor.model_loader import utils

            settings.logger().warning(
                "vllm-dsa-dbo: %s builds models in place of the plugin's load-time check "
                "(another plugin replaced initialize_model after register()): the model is "
                "checked as its build ends",
                where(utils.initialize_model),
            )
            vllm_config = get_current_vllm_config()
            refuse_hisparse(vllm_config)
            check_model(model, vllm_config)
        return result

    return record_metadata_for_reloading


def _check_base_loader(target: ModuleType) -> None:
    """Check every model the module's initialize_model builds, whoever calls it."""
    _checking("initialize_model")(target)
    target.record_metadata_for_reloading = checked_build_end(target.record_metadata_for_reloading)


def _checking(name: str) -> Callable[[ModuleType], None]:
    """The patch that checks every model `name` of its target builds."""
    return lambda target: replace_function(target, name, checked_build(getattr(target, name)))


BASE_LOADER = Patch(
    name="base_loader",
    fits={"0.33.0": "ee4508ceb2b84253", "0.34.0": "ee4508ceb2b84253"},
    target="vllm.model_executor.model_loader.utils",
    replaces=("initialize_model", "record_metadata_for_reloading"),
    why=(
        "An operator cannot see from the logs whether the fix is active for a model "
        "or what it costs; and models whose leaders write the top-k outside "
        "the per-microbatch writers (the deepseek_v2 / glm4_moe_lite DSA path on "
        "ROCm), or whose followers build private index groups "
        "that nothing wires (HYV4 on ROCm), would still share it between "
        "microbatches. Every vLLM 0.33.0 loader builds its model through this "
        "module's initialize_model (the base, tensorizer and IPC loaders import it "
        "by value), except a vLLM-tensorized one (the tensorizer patch)."
    ),
    how=(
        "Replaces initialize_model, in its module and in every module holding it "
        "by value: after the outermost build, each worker "
        "refuses, under DBO, a model whose followers would read shared top-k "
        "state (groups built for fewer microbatches than the run has, leaders "
        "not wired to the per-microbatch buffers, followers in "
        "private groups nothing wired, followers of a sparse MLA backend without "
        "index groups (XPU_MLA_SPARSE), groups a patch left unapplied, "
        "DeepSeek-V4.1 buffers without per-microbatch copies, or MiniMax-M3 ROCm "
        "cross-layer index buffers), else logs one INFO line with the microbatch "
        "count, the index groups with followers (or V4.1's copied buffers), the "
        "bytes allocated and the sparse MLA backend, and nothing when nothing was "
        "allocated. Before the build it refuses HiSparse under DBO. The check reads "
        "each index group with followers as a microbatch-1 thread does, through the "
        "getters the forward uses, and refuses a group whose microbatch 1 resolves "
        "microbatch 0's top-k (a getter another plugin put back over the fix's). It "
        "also wraps record_metadata_for_reloading, which vLLM's initialize_model calls "
        "on the model it built: where another plugin put its initialize_model over ours "
        "after register(), the model is checked there, and a warning names that function."
    ),
    upstream=(
        "none for the log line; the refusals stand in for fixes PR #60734 does "
        "not make (the deepseek_v2 path on ROCm, HYV4 on ROCm, XPU_MLA_SPARSE) "
        "and, on ROCm, for PR #56476 (DeepSeek-V4.1)"
    ),
    remove_when="with the other patches (the vLLM release that merges PR #60734)",
    apply=_check_base_loader,
    check=lambda target: takes_vllm_config(target.initialize_model),
)
TENSORIZER = Patch(
    name="tensorizer",
    fits={"0.33.0": "4edd4d350828a1dd", "0.34.0": "4edd4d350828a1dd"},
    target="vllm.model_executor.model_loader.tensorizer",
    replaces=("init_tensorizer_model",),
    why=(
        "TensorizerLoader builds a vLLM-tensorized model with init_tensorizer_model, "
        "which calls the model class itself, not initialize_model: without this, "
        "such a model would skip the load-time check and the startup line."
    ),
    how=(
        "Replaces init_tensorizer_model, in its module and in tensorizer_loader "
        "(which imports it by value), with the load-time check of the base_loader "
        "patch around it."
    ),
    upstream="none: the load-time check has no upstream counterpart",
    remove_when="with the base_loader patch",
    apply=_checking("init_tensorizer_model"),
    check=lambda target: takes_vllm_config(target.init_tensorizer_model),
)
# With both in force every model build is checked at load; without, the guard refuses.
PATCHES = (BASE_LOADER, TENSORIZER)
