"""Models that hand top-k between layers outside vLLM's index groups are
refused under DBO at model load: DeepSeek-V4.1 with no per-microbatch copies
(index sources, candidate blocks: the ROCm path) and MiniMax-M3 on ROCm with
use_index_cache.

Their attention layers cannot be built on a CPU; each stand-in layer carries
the attribute the real layer sets, decided by vLLM's own rule where it has one.
The model is built through the loader's initialize_model, as a worker does.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn as nn

# Three sparse layers, as vLLM 0.33.0 (sparse_attention_freq) and 0.34.0 (layer_types) read them.
MINIMAX_M3_INDEX_CACHE = SimpleNamespace(
    use_index_cache=True,
    index_topk_freq=2,
    sparse_attention_config={"sparse_attention_freq": [1, 1, 1]},
    layer_types=["minimax_m3_sparse"] * 3,
)

MINIMAX_M3_NO_INDEX_CACHE = SimpleNamespace(
    **{**vars(MINIMAX_M3_INDEX_CACHE), "use_index_cache": False}
)


def import_rocm_module(name: str):
    """A ROCm-only vLLM module, imported on a CPU host: vLLM 0.34.0's `platforms.rocm` asks
    the GPU for its architecture at import."""
    arch = SimpleNamespace(gcnArchName="gfx942")
    with mock.patch.object(torch.cuda, "get_device_properties", lambda *args: arch):
        return importlib.import_module(name)


def minimax_m3_layer(layer_id: int, config: SimpleNamespace) -> nn.Module:
    model = import_rocm_module("vllm.models.minimax_m3.amd.model")
    layer = nn.Module()
    layer.skip_index_topk = model._should_skip_index_topk(config, layer_id)
    return layer


def deepseek_v41_layer(
    layer_id: int, index_sources: tuple[int, ...], candidate_source: int
) -> nn.Module:
    """`DeepseekV4Attention`'s topology attributes for a compressed layer of a
    model nothing wired (the ROCm path): its buffers have no microbatch copies."""
    layer = nn.Module()
    layer.layer_id = layer_id
    layer.index_source_layer_id = max(s for s in index_sources if s <= layer_id)
    layer.candidate_source_layer = candidate_source
    layer.indexer = nn.Module() if layer_id in index_sources else None
    layer.topk_indices_buffer = torch.empty(4, 2, dtype=torch.int32)
    layer.candidate_block_buffer = torch.empty(4, 2, dtype=torch.int32)
    return layer


MODELS = {
    "minimax_m3 index cache": (
        lambda: [minimax_m3_layer(i, MINIMAX_M3_INDEX_CACHE) for i in range(3)],
        True,
    ),
    "minimax_m3 without index cache": (
        lambda: [minimax_m3_layer(i, MINIMAX_M3_NO_INDEX_CACHE) for i in range(3)],
        False,
    ),
    "deepseek_v41 index sharing": (
        lambda: [deepseek_v41_layer(i, (0, 2), -1) for i in range(3)],
        True,
    ),
    "deepseek_v41 candidate blocks": (
        lambda: [deepseek_v41_layer(i, (0, 1, 2), 0) for i in range(3)],
        True,
    ),
    "deepseek_v41 every layer its own index source": (
        lambda: [deepseek_v41_layer(i, (0, 1, 2), -1) for i in range(3)],
        False,
    ),
}


def load(vllm_env, monkeypatch, layers, enable_dbo: bool) -> nn.Module:
    """The model built by the loader's (patched) initialize_model."""
    from vllm.model_executor.model_loader import base_loader

    class Model(nn.Module):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__()
            self.layers = nn.ModuleList(layers())

    from vllm.config import CompilationMode

    monkeypatch.setattr(vllm_env.parallel_config, "enable_dbo", enable_dbo)
    monkeypatch.setattr(vllm_env.compilation_config, "mode", CompilationMode.NONE)
    return base_loader.initialize_model(
        vllm_env, model_class=Model, model_config=SimpleNamespace(hf_config=None)
    )


@pytest.mark.parametrize("name", MODELS)
def test_cross_layer_topk_outside_index_groups_refused_under_dbo(vllm_env, monkeypatch, name):
    layers, refused = MODELS[name]
    load(vllm_env, monkeypatch, layers, enable_dbo=False)
    if refused:
        with pytest.raises(ValueError, match="Drop --enable-dbo"):
            load(vllm_env, monkeypatch, layers, enable_dbo=True)
    else:
        load(vllm_env, monkeypatch, layers, enable_dbo=True)
