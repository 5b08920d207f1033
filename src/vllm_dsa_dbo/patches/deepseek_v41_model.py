"""Patch of `vllm.models.deepseek_v41.nvidia.model`."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from vllm_dsa_dbo.patches._shared import Patch, call_after_init, unset_attributes
from vllm_dsa_dbo.ubatch_buffers import add_ubatch_copies


def hand_offs(config: Any, layers: Iterable[int] | None = None) -> tuple[list[int], list[int]]:
    """Of a DeepSeek-V4.1 model's decoder layers (`layers`, default all): those reusing an
    index source's top-k, and those whose indexer masks its scores with an earlier layer's
    candidate blocks; by `DeepseekV4Attention.__init__`'s rule, from the model's config."""
    num_layers = config.num_hidden_layers
    ratios = getattr(config, "compress_ratios", None) or []
    sources = getattr(config, "index_source_layer_ids", None) or ()
    candidate_source = getattr(config, "candidate_source_layer_id", -1)
    # DeepseekV4Model allocates no candidate buffer without candidate_topk_blocks.
    candidates = candidate_source >= 0 and getattr(config, "candidate_topk_blocks", 0) > 0
    reusing, readers = [], []
    for i in range(num_layers) if layers is None else layers:
        if i < len(ratios) and int(ratios[i]) > 0 and max(s for s in sources if s <= i) != i:
            reusing.append(i)
        if candidates and i < num_layers and i in sources and 0 <= candidate_source < i:
            readers.append(i)
    return reusing, readers


def handed_off_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model-wide buffers some layer of `model` reads from another layer."""
    built = [m.layer_id for m in model.modules() if hasattr(m, "candidate_source_layer")]
    reusing, readers = hand_offs(model.config, built)
    buffers = []
    if reusing:
        buffers.append(model.topk_indices_buffer)
    if readers:
        buffers.append(model.candidate_block_buffer)
    return buffers


def keep_index_state_per_ubatch(model: torch.nn.Module) -> None:
    """Register per-microbatch copies of a V4.1 model's handed-off buffers."""
    from vllm.v1.worker.ubatch_utils import get_num_ubatches

    num_ubatches = get_num_ubatches(model.parallel_config)
    if num_ubatches < 2:
        return
    for buffer in handed_off_buffers(model):
        add_ubatch_copies(buffer, num_ubatches - 1)


def check(target: ModuleType) -> str | None:
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    model = target.DeepseekV4Model
    if issubclass(model, TorchCompileWithNoGuardsWrapper):
        # Traced code takes the buffer as stored: microbatch 0's in every microbatch.
        return "DeepseekV4Model is torch.compile'd"
    return unset_attributes(
        model.__init__, "topk_indices_buffer", "candidate_block_buffer", "parallel_config"
    ) or unset_attributes(model.__init__, "config")


def apply(target: ModuleType) -> None:
    call_after_init(target.DeepseekV4Model, keep_index_state_per_ubatch)


PATCH = Patch(
    name="deepseek_v41_model",
    fits={"0.33.0": "b3e469d2b271536d", "0.34.0": "fe0a98313417149a"},
    differs=(
        "vLLM 0.34.0: wo_a grouping, replay and Engram changes; the top-k and candidate "
        "buffers are allocated as before"
    ),
    target="vllm.models.deepseek_v41.nvidia.model",
    replaces=("DeepseekV4Model.__init__",),
    why=(
        "DeepseekV4Model (CUDA) allocates one topk_indices_buffer and one "
        "candidate_block_buffer for all layers; under DBO each microbatch's "
        "index sources write them and its reusing layers read them after the "
        "other microbatch has run in between."
    ),
    how=(
        "Wraps DeepseekV4Model.__init__: with several microbatches, registers one "
        "copy per extra microbatch of the top-k buffer when some layer reuses an "
        "index source's top-k, and of the candidate-block buffer when some "
        "indexer reads another layer's candidates (the rule `memory` reports "
        "too); deepseek_v41_attention resolves every access to them. Nothing is "
        "allocated otherwise."
    ),
    upstream="vllm PR #56476 (open): per-microbatch sparse index state for DeepSeek-V4.1",
    remove_when="the vLLM release that merges PR #56476",
    requires=("deepseek_v41_attention",),
    apply=apply,
    check=check,
)
