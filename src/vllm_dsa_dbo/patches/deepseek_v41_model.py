"""Patch of `vllm.models.deepseek_v41.nvidia.model`."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from vllm_dsa_dbo.patches import Patch, call_after_init
from vllm_dsa_dbo.patches.deepseek_v41_attention import unset_attributes
from vllm_dsa_dbo.ubatch_buffers import add_ubatch_copies, stored_buffer, ubatch_copies

PATCH = Patch(
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
        "indexer reads another layer's candidates; deepseek_v41_attention "
        "resolves every access to them. Nothing is allocated otherwise."
    ),
    upstream="vllm PR #56476 (open): per-microbatch sparse index state for DeepSeek-V4.1",
    remove_when="the vLLM release that merges PR #56476",
)

REQUIRES = ("deepseek_v41_attention",)


def reuses_topk(attn: Any) -> bool:
    """A V4.1 layer that reads the top-k of an index source below it."""
    source = getattr(attn, "index_source_layer_id", None)
    return source is not None and source != getattr(attn, "layer_id", source)


def reads_candidates(attn: Any) -> bool:
    """A V4.1 indexer that masks its scores with an earlier layer's candidates."""
    layer_id = getattr(attn, "layer_id", None)
    source = getattr(attn, "candidate_source_layer", -1)
    return (
        getattr(attn, "indexer", None) is not None
        and layer_id is not None
        and 0 <= source < layer_id
        # DeepseekV4Model allocates none without candidate_topk_blocks.
        and stored_buffer(attn, "candidate_block_buffer") is not None
    )


def unwired_hand_off(attn: Any) -> bool:
    """A V4.1 layer reading another layer's top-k or candidates from a buffer
    that has no per-microbatch copies."""
    if reuses_topk(attn) and not ubatch_copies(stored_buffer(attn, "topk_indices_buffer")):
        return True
    return reads_candidates(attn) and not ubatch_copies(
        stored_buffer(attn, "candidate_block_buffer")
    )


def hand_offs(attns: Iterable[Any]) -> tuple[list[int], list[int]]:
    """Of V4.1 attention layers: those reusing an index source's top-k, and
    those whose indexer reads an earlier layer's candidates."""
    attns = list(attns)
    return (
        [a.layer_id for a in attns if reuses_topk(a)],
        [a.layer_id for a in attns if reads_candidates(a)],
    )


def handed_off_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model-wide buffers some layer of `model` reads from another layer."""
    reusing, readers = hand_offs(m for m in model.modules() if hasattr(m, "candidate_source_layer"))
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
    )


def apply(target: ModuleType) -> None:
    call_after_init(target.DeepseekV4Model, keep_index_state_per_ubatch)


def copied_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers with per-microbatch copies that layers of `model` hold, once each."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name in ("topk_indices_buffer", "candidate_block_buffer"):
            buffer = stored_buffer(module, name)
            if ubatch_copies(buffer):
                found[id(buffer)] = buffer
    return list(found.values())


def describe(model: torch.nn.Module) -> str | None:
    """The startup line for a V4.1 model with copies, else None."""
    buffers = copied_buffers(model)
    if not buffers:
        return None
    copies = [c for b in buffers for c in ubatch_copies(b)]
    allocated = sum(c.numel() * c.element_size() for c in copies)
    return (
        f"vllm-dsa-dbo: {type(model).__name__} keeps DeepSeek-V4.1 index state per DBO "
        f"microbatch: {len(ubatch_copies(buffers[0])) + 1} microbatches, {len(buffers)} "
        f"handed-off buffers, {allocated:,} bytes ({allocated / 2**20:.1f} MiB) allocated"
    )
