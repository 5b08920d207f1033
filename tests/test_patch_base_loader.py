"""The load-time check runs whichever vLLM 0.33.0 loader builds the model.

Each loader class of vLLM's load-format table builds a model whose layers hand
top-k outside index groups (MiniMax-M3 on ROCm with use_index_cache, decided by
vLLM's own rule): with DBO it must be refused on every path, before any weight
is read. Weight sources the loaders would reach later (tensorizer streams, the
IPC weight-cache daemon, the ModelExpress package) are faked only up to the
model build.
"""

from __future__ import annotations

import inspect
import logging
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn as nn

from test_cross_layer_refusal import MINIMAX_M3_INDEX_CACHE, minimax_m3_layer
from test_plugin import run_python


class RefusedModel(nn.Module):
    """Layers whose top-k reuse the plugin does not keep per microbatch."""

    def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
        super().__init__()
        self.layers = nn.ModuleList(minimax_m3_layer(i, MINIMAX_M3_INDEX_CACHE) for i in range(3))


MODEL_CONFIG = SimpleNamespace(
    dtype=torch.float32,
    hf_config=SimpleNamespace(),
    quantization=None,
    model="refused",
    revision=None,
)


def fake_modelexpress(monkeypatch) -> None:
    """The ModelExpress package's loader, as a loader that builds through vLLM's
    initialize_model, imported by value the way outside code would."""
    from vllm.model_executor.model_loader.utils import initialize_model

    class MxModelLoader:
        def __init__(self, load_config) -> None:
            self.load_config = load_config

        def load_model(self, vllm_config, model_config, prefix=""):
            return initialize_model(vllm_config=vllm_config, model_config=model_config)

    module = ModuleType("modelexpress.engines.vllm.loader")
    module.MxModelLoader = MxModelLoader
    monkeypatch.setitem(sys.modules, module.__name__, module)


def fake_ipc_daemon(monkeypatch) -> None:
    """A weight-cache daemon on a CUDA-like platform that serves no tensors."""
    from vllm.model_executor.model_loader.weight_cache import ipc_loader

    monkeypatch.setattr(ipc_loader, "check_ipc_platform_support", lambda: None)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    state = SimpleNamespace(entries={}, attrs={})
    monkeypatch.setattr(ipc_loader.IpcModelLoader, "_fetch_entries", lambda self, *a, **k: state)
    for step in ("_apply_entries", "_send_release", "_watch_daemon"):
        monkeypatch.setattr(ipc_loader.IpcModelLoader, step, lambda self, *args: None)
    monkeypatch.setattr(ipc_loader, "process_weights_after_loading", lambda *args: None)


def fake_tensorizer_stream(vllm_tensorized: bool):
    def fake(monkeypatch) -> None:
        from vllm.model_executor.model_loader import tensorizer_loader

        monkeypatch.setattr(tensorizer_loader, "is_vllm_tensorized", lambda config: vllm_tensorized)

    return fake


def no_fake(monkeypatch) -> None:
    pass


# Path name: (load format, extra config, fake of what the loader would read from).
LOAD_PATHS = {
    "auto": ("auto", {}, no_fake),
    "dummy": ("dummy", {}, no_fake),
    "runai_streamer": ("runai_streamer", {}, no_fake),
    "sharded_state": ("sharded_state", {}, no_fake),
    "tensorizer_serialized": (
        "tensorizer",
        {"tensorizer_config": {"tensorizer_uri": "/nonexistent/model.tensors"}},
        fake_tensorizer_stream(False),
    ),
    "tensorizer_vllm_tensorized": (
        "tensorizer",
        {"tensorizer_config": {"tensorizer_uri": "/nonexistent/model.tensors"}},
        fake_tensorizer_stream(True),
    ),
    "ipc_cache": ("ipc_cache", {"fallback": False}, fake_ipc_daemon),
    "ipc_cache_falling_back_to_disk": (
        "ipc_cache",
        {"fallback": True},
        fake_ipc_daemon,
    ),
    "modelexpress": ("modelexpress", {}, fake_modelexpress),
}


def test_every_load_format_is_covered():
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    covered = {LOAD_PATHS[name][0] for name in LOAD_PATHS}
    loader_classes = set(_LOAD_FORMAT_TO_MODEL_LOADER.values())
    assert {_LOAD_FORMAT_TO_MODEL_LOADER[f] for f in covered} == loader_classes


def load(vllm_env, monkeypatch, path: str, enable_dbo: bool) -> nn.Module:
    from vllm.config import CompilationMode
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader, tensorizer_loader, utils

    load_format, extra, fake = LOAD_PATHS[path]
    fake(monkeypatch)
    for module in (utils, tensorizer_loader):  # tensorizer_loader's by value in vLLM 0.33.0
        monkeypatch.setattr(
            module, "get_model_architecture", lambda config: (RefusedModel, "R"), raising=False
        )
    monkeypatch.setattr(vllm_env.parallel_config, "enable_dbo", enable_dbo)
    monkeypatch.setattr(vllm_env.compilation_config, "mode", CompilationMode.NONE)
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=extra)
    monkeypatch.setattr(vllm_env, "load_config", load_config)
    monkeypatch.setattr(vllm_env, "model_config", MODEL_CONFIG)
    loader = get_model_loader(load_config)
    return loader.load_model(vllm_config=vllm_env, model_config=MODEL_CONFIG)


@pytest.mark.parametrize("path", LOAD_PATHS)
def test_refused_model_is_refused_whichever_loader_builds_it(vllm_env, monkeypatch, caplog, path):
    """By the check around the loader's build, not the fallback at the build's end."""
    caplog.set_level(logging.WARNING, logger="vllm.dsa_dbo")
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        load(vllm_env, monkeypatch, path, enable_dbo=True)
    assert "in place of the plugin's load-time check" not in caplog.text


def test_loaders_imported_before_registration_get_the_check():
    result = run_python(
        """
        from vllm.model_executor import model_loader
        from vllm.model_executor.model_loader import (
            base_loader, tensorizer, tensorizer_loader, utils,
        )
        from vllm.model_executor.model_loader.weight_cache import ipc_loader
        stock = utils.initialize_model, tensorizer.init_tensorizer_model
        import vllm_dsa_dbo
        vllm_dsa_dbo.register()
        # tensorizer_loader holds it by value in vLLM 0.33.0, not in 0.34.0.
        holders = [m for m in (utils, base_loader, tensorizer_loader, ipc_loader)
                   if hasattr(m, "initialize_model")]
        print("BUILD", len(holders) >= 3
              and all(m.initialize_model.__wrapped__ is stock[0] for m in holders))
        tensorized = (tensorizer, tensorizer_loader)
        print("TENSORIZED", all(m.init_tensorizer_model.__wrapped__ is stock[1]
                                for m in tensorized))
        """
    )
    assert "BUILD True" in result.stdout, result.stderr[-3000:]
    assert "TENSORIZED True" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("build", ["initialize_model", "init_tensorizer_model"])
def test_startup_line_whichever_function_builds_the_model(fake_gpu, monkeypatch, caplog, build):
    import logging

    from vllm.config import CompilationMode
    from vllm.model_executor.model_loader import tensorizer_loader, utils

    from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, attention_module

    class Model(nn.Module):
        def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
            super().__init__()
            stack = SharedTopkStack([True, False, False], num_ubatches=None)
            self.layers = nn.ModuleList(attention_module(i, stack.buffer) for i in stack.impls)

    monkeypatch.setattr(fake_gpu.parallel_config, "enable_dbo", True)
    monkeypatch.setattr(fake_gpu.compilation_config, "mode", CompilationMode.NONE)
    caplog.set_level(logging.INFO, logger="vllm.dsa_dbo")
    if build == "initialize_model":
        utils.initialize_model(fake_gpu, model_class=Model, model_config=MODEL_CONFIG)
    else:
        config = SimpleNamespace(
            hf_config=SimpleNamespace(), dtype=torch.float32, model_class=Model
        )
        tensorizer_loader.init_tensorizer_model(tensorizer_config=config, vllm_config=fake_gpu)
    assert "Model keeps shared top-k per DBO microbatch: 2 microbatches" in caplog.text


def test_initialize_model_replaced_after_registration_still_checks(fake_gpu, monkeypatch, caplog):
    """A second plugin took vLLM's initialize_model at import and puts its own over ours
    (and every alias) after register(): the model is still checked as its build ends, and
    the log names the function that replaced ours."""
    from vllm.model_executor.model_loader import base_loader, utils

    from vllm_dsa_dbo.patches._shared import replace_function

    stock = inspect.unwrap(utils.initialize_model)

    def theirs(*args, **kwargs):
        return stock(*args, **kwargs)

    for module in list(sys.modules.values()):  # every alias replace_function rebinds
        if getattr(module, "__dict__", {}).get("initialize_model") is utils.initialize_model:
            monkeypatch.setattr(module, "initialize_model", utils.initialize_model)
    replace_function(utils, "initialize_model", theirs)
    assert base_loader.initialize_model is theirs
    from vllm.config import CompilationMode

    monkeypatch.setattr(fake_gpu.parallel_config, "enable_dbo", True)
    monkeypatch.setattr(fake_gpu.compilation_config, "mode", CompilationMode.NONE)
    caplog.set_level(logging.WARNING, logger="vllm.dsa_dbo")
    with pytest.raises(ValueError, match="hands top-k .* in buffers that are not index groups"):
        base_loader.initialize_model(fake_gpu, model_class=RefusedModel, model_config=MODEL_CONFIG)
    replaced = f"theirs at {__file__}:{theirs.__code__.co_firstlineno}"
    assert f"{replaced} builds models in place of" in caplog.text


def test_a_wrapper_over_the_load_check_is_named(fake_gpu, monkeypatch, caplog):
    """Another plugin's wrapper over the plugin's initialize_model: the check runs under it,
    and the log names the wrapper."""
    import functools

    from vllm.config import CompilationMode
    from vllm.model_executor.model_loader import utils

    from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, attention_module

    ours = utils.initialize_model

    @functools.wraps(ours)
    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    class Model(nn.Module):
        def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
            super().__init__()
            stack = SharedTopkStack([True, False, False], num_ubatches=None)
            self.layers = nn.ModuleList(attention_module(i, stack.buffer) for i in stack.impls)

    monkeypatch.setattr(utils, "initialize_model", theirs)
    monkeypatch.setattr(fake_gpu.parallel_config, "enable_dbo", True)
    monkeypatch.setattr(fake_gpu.compilation_config, "mode", CompilationMode.NONE)
    caplog.set_level(logging.INFO, logger="vllm.dsa_dbo")
    utils.initialize_model(fake_gpu, model_class=Model, model_config=MODEL_CONFIG)
    assert "Model keeps shared top-k per DBO microbatch: 2 microbatches" in caplog.text
    wrapper = f"theirs at {__file__}:{theirs.__code__.co_firstlineno}"
    assert (
        "other code wraps vllm.model_executor.model_loader.utils.initialize_model "
        f"(by {wrapper}), which the plugin set" in caplog.text
    )


def test_a_wrapper_over_a_patched_getter_is_named_at_load(fake_gpu, monkeypatch, caplog):
    """Another plugin's wrapper over the getter the fix set on the sparse MLA impls, put on
    after register(): the model loads (the fix's getter runs under it), and the log names it."""
    import functools

    from vllm.config import CompilationMode
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SharedTopkIndicesBuffer,
    )
    from vllm.model_executor.model_loader import utils

    from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, attention_module

    ours = SharedTopkIndicesBuffer.topk_indices_buffer

    @functools.wraps(ours.fget)
    def theirs(self):
        return ours.fget(self)

    class Model(nn.Module):
        def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
            super().__init__()
            stack = SharedTopkStack([True, False, False], num_ubatches=None)
            self.layers = nn.ModuleList(attention_module(i, stack.buffer) for i in stack.impls)

    monkeypatch.setattr(SharedTopkIndicesBuffer, "topk_indices_buffer", property(theirs, ours.fset))
    monkeypatch.setattr(fake_gpu.parallel_config, "enable_dbo", True)
    monkeypatch.setattr(fake_gpu.compilation_config, "mode", CompilationMode.NONE)
    caplog.set_level(logging.INFO, logger="vllm.dsa_dbo")
    utils.initialize_model(fake_gpu, model_class=Model, model_config=MODEL_CONFIG)
    assert "Model keeps shared top-k per DBO microbatch: 2 microbatches" in caplog.text
    getter = "vllm.model_executor.layers.attention.sparse_mla_attention.SharedTopkIndicesBuffer"
    wrapper = f"theirs at {__file__}:{theirs.__code__.co_firstlineno}"
    assert (
        f"other code wraps {getter}.topk_indices_buffer (by {wrapper}), which the plugin set"
        in caplog.text
    )
