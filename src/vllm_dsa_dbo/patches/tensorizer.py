"""Patch of `vllm.model_executor.model_loader.tensorizer`."""

from __future__ import annotations

from types import ModuleType

from vllm_dsa_dbo.patches import Patch, replace_function
from vllm_dsa_dbo.patches.base_loader import checked_build, takes_vllm_config

PATCH = Patch(
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
)


def check(target: ModuleType) -> str | None:
    return takes_vllm_config(target.init_tensorizer_model)


def apply(target: ModuleType) -> None:
    replace_function(target, "init_tensorizer_model", checked_build(target.init_tensorizer_model))
