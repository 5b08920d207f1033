"""Registration checks each private vLLM object a patch relies on; on a
mismatch that patch (and every patch that needs it) is left unapplied with one
warning, and the loader refuses the models that needed it.

The checks are run against broken copies of vLLM's objects: vLLM's own
microbatch registry, its `eager_break_during_capture` wrapper, classes shaped
like the ones patched. The last tests break vLLM itself before `register()`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from test_plugin import run_python
from vllm_dsa_dbo.diagnostics import refusals
from vllm_dsa_dbo.diagnostics.load_check import BASE_LOADER, TENSORIZER
from vllm_dsa_dbo.patches import (
    deepseek_v41_attention,
    deepseek_v41_model,
    index_group,
    sparse_attn_indexer,
    sparse_mla_attention,
)


@pytest.mark.parametrize(
    "attribute, replacement, reason",
    [
        ("_THREAD_ID_TO_CONTEXT", lambda u: {}, "is not the dict it was at import"),
        (
            "UBatchContext",
            lambda u: type("UBatchContext", (), {"__enter__": lambda self: self}),
            "no longer registers its thread",
        ),
        ("dbo_current_ubatch_id", lambda u: lambda: 0, "reads (vLLM, plugin) = (0, 1)"),
    ],
    ids=["registry_rebound", "threads_registered_elsewhere", "vllm_reads_elsewhere"],
)
def test_thread_registry_check(monkeypatch, attribute, replacement, reason):
    from vllm.v1.attention.backends.mla import index_group as target
    from vllm.v1.worker import ubatching

    assert index_group.check(target) is None
    monkeypatch.setattr(ubatching, attribute, replacement(ubatching))
    found = index_group.check(target)
    assert found is not None and reason in found
    assert not ubatching._THREAD_ID_TO_CONTEXT


def test_thread_registry_check_reads_through_a_wrapper_of_vllms_enter(monkeypatch):
    """A wrapper over UBatchContext.__enter__ that calls vLLM's (the harness counts microbatches
    so) still registers the thread: the check reads the code under functools.wraps."""
    import functools

    from vllm.v1.attention.backends.mla import index_group as target
    from vllm.v1.worker import ubatching

    stock = ubatching.UBatchContext.__enter__

    @functools.wraps(stock)
    def counted(self):
        return stock(self)

    monkeypatch.setattr(ubatching.UBatchContext, "__enter__", counted)
    assert index_group.check(target) is None


class Builder:
    def __init__(self, logical_topk_indices, max_decode_rows=None) -> None: ...

    def register_layer(self, is_index_producing_layer, vllm_config=None, **kwargs): ...


class RenamedBuilder(Builder):
    def __init__(self, topk_indices, max_decode_rows=None) -> None: ...


def test_builder_signature_check():
    assert index_group.builder_mismatch(Builder) is None
    found = index_group.builder_mismatch(RenamedBuilder)
    assert found is not None and "SparseMLAIndexGroupBuilder.__init__ takes" in found


def buffer_mixin(fget) -> SimpleNamespace:
    buffer = property(fget, lambda self, value: None)
    mixin = type("SharedTopkIndicesBuffer", (), {"topk_indices_buffer": buffer})
    return SimpleNamespace(SharedTopkIndicesBuffer=mixin)


def test_buffer_property_check():
    def vllms(self):
        if self._indexer is not None:
            return self._indexer.topk_indices_buffer
        return self._topk_indices_buffer

    assert sparse_mla_attention.check(buffer_mixin(vllms)) is None
    found = sparse_mla_attention.check(buffer_mixin(lambda self: self._buffer))
    assert found is not None and "reads ['_buffer']" in found


def kernel(q, k_cache_prefix, topk_indices_buffer): ...


def renamed_kernel(q, k_cache_prefix, topk_buffer): ...


def op_module(body, wraps=kernel) -> SimpleNamespace:
    """A module whose op body is vLLM's eager_break_during_capture wrapper of `wraps`."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    op = eager_break_during_capture(wraps)
    if body is not wraps:
        sparse_attn_indexer.closure_cell(op, "fn").cell_contents = body
    return SimpleNamespace(sparse_attn_indexer=op)


@pytest.mark.parametrize(
    "target, reason",
    [
        pytest.param(lambda: op_module(kernel), None, id="as_vllm"),
        pytest.param(
            lambda: SimpleNamespace(sparse_attn_indexer=kernel),
            "no longer a wrapper",
            id="unwrapped",
        ),
        pytest.param(lambda: op_module(renamed_kernel), "not the kernel it wraps", id="other_cell"),
        pytest.param(
            lambda: op_module(renamed_kernel, renamed_kernel),
            "takes no topk_indices_buffer",
            id="renamed_parameter",
        ),
    ],
)
def test_op_body_check(target, reason):
    found = sparse_attn_indexer.check(target())
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


def test_groups_no_patch_touched_are_refused_under_dbo():
    """vLLM's own group class (index_group left unapplied) has no copies at all."""
    import torch.nn as nn

    layer = nn.Module()
    layer.impl = SimpleNamespace(index_group=SimpleNamespace(num_layers=2, has_indexer=True))
    model = nn.ModuleList([layer])
    refusals.check_wired(model, num_ubatches=1)
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        refusals.check_wired(model, num_ubatches=2)


def test_groups_built_for_fewer_microbatches_than_the_run_are_refused(fake_gpu):
    """A builder given num_ubatches=1 in a DBO build (vllm PR #60734's default, which
    its builders other than DeepseekV32Model's keep) allocates no copies."""
    import torch.nn as nn

    from vllm_dsa_dbo.cpu_dbo import SharedTopkStack

    def model(num_ubatches: int) -> nn.Module:
        layers = [nn.Module() for _ in range(3)]
        for layer, impl in zip(layers, SharedTopkStack([True, False, False], num_ubatches).impls):
            layer.impl = impl
        return nn.ModuleList(layers)

    refusals.check_wired(model(2), num_ubatches=2)
    # Refused by this rule, before the load-time probe would refuse it too.
    with pytest.raises(ValueError, match="leader layers write the top-k without going through"):
        refusals.check_wired(model(1), num_ubatches=2)


def test_load_seam_signature_checks():
    def build(config, *, prefix=""): ...

    assert "takes no vllm_config" in BASE_LOADER.check(SimpleNamespace(initialize_model=build))
    assert "takes no vllm_config" in TENSORIZER.check(SimpleNamespace(init_tensorizer_model=build))
    from vllm.model_executor.model_loader import tensorizer as vllm_tensorizer
    from vllm.model_executor.model_loader import utils

    assert BASE_LOADER.check(utils) is None and TENSORIZER.check(vllm_tensorizer) is None


class Op:
    def __init__(self, topk_indices_buffer, candidate_blocks=None) -> None:
        self.topk_indices_buffer = topk_indices_buffer
        self.candidate_blocks = candidate_blocks


class OpWithoutCandidates:
    def __init__(self, topk_indices_buffer) -> None:
        self.topk_indices_buffer = topk_indices_buffer


def v41_attention_module(op: type) -> SimpleNamespace:
    from vllm.models.deepseek_v41 import attention

    indexer = type("DeepseekV4Indexer", (attention.DeepseekV4Indexer,), {"mqa_cls": op})
    return SimpleNamespace(
        DeepseekV4Attention=attention.DeepseekV4Attention, DeepseekV4Indexer=indexer
    )


def test_deepseek_v41_attention_check():
    from vllm.models.deepseek_v41 import attention

    assert deepseek_v41_attention.check(attention) is None
    assert deepseek_v41_attention.check(v41_attention_module(Op)) is None
    found = deepseek_v41_attention.check(v41_attention_module(OpWithoutCandidates))
    assert found is not None and "no longer sets ['candidate_blocks']" in found


def test_deepseek_v41_model_check():
    import torch.nn as nn
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.models.deepseek_v41.nvidia import model

    assert deepseek_v41_model.check(model) is None
    stock = model.DeepseekV4Model
    compiled = type("DeepseekV4Model", (stock, TorchCompileWithNoGuardsWrapper), {})
    found = deepseek_v41_model.check(SimpleNamespace(DeepseekV4Model=compiled))
    assert found is not None and "torch.compile'd" in found

    class Renamed(nn.Module):
        def __init__(self, *, vllm_config, prefix="") -> None:
            self.topk_indices_buffer = self.parallel_config = None

    found = deepseek_v41_model.check(SimpleNamespace(DeepseekV4Model=Renamed))
    assert found is not None and "no longer sets ['candidate_block_buffer']" in found


# A GLM-5-shaped stack (leader, two followers) built by initialize_model under DBO.
LOAD_GLM5_STACK = """
    import torch.nn as nn
    from types import SimpleNamespace
    from vllm.config import CompilationMode
    from vllm.model_executor.model_loader import utils
    from vllm_dsa_dbo import patches
    from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, attention_module
    from vllm_dsa_dbo.diagnostics import load_check

    every = [*patches.fix_patches(), *load_check.PATCHES]
    print("UNAPPLIED", sorted(n for n, r in patches.diagnose(every).items() if r))

    class Model(nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            stack = SharedTopkStack([True, False, False], num_ubatches=None)
            self.layers = nn.ModuleList(attention_module(i, stack.buffer) for i in stack.impls)

    with cpu_dbo.cpu_vllm() as config, cpu_dbo.fake_streams():
        config.compilation_config.mode = CompilationMode.NONE
        for dbo in (False, True):
            config.parallel_config.enable_dbo = dbo
            try:
                utils.initialize_model(
                    config, model_class=Model, model_config=SimpleNamespace(hf_config=None)
                )
                print("LOADED", dbo)
            except ValueError as e:
                print("REFUSED", dbo, " ".join(str(e).split()))
"""
CPU_DBO = """
    import logging
    logging.basicConfig(level=logging.INFO)
    from vllm_dsa_dbo.demo import use_cpu
    use_cpu()
    from vllm_dsa_dbo import cpu_dbo
"""
REGISTER = """
    import vllm_dsa_dbo
    vllm_dsa_dbo.register()
"""
BREAK_REGISTRY = """
    import vllm_dsa_dbo.core
    from vllm.v1.worker import ubatching
    ubatching._THREAD_ID_TO_CONTEXT = {}
"""
# A point release of the installed release's series, DeepseekV32Attention's source changed
# (one line added) as inspect reads it.
POINT_RELEASE = """
    import vllm
    from vllm_dsa_dbo import settings
    release = settings.release_of(vllm.__version__)
    vllm.__version__ = release.rsplit(".", 1)[0] + ".9"
"""
CHANGE_SEAM = """
    import inspect, linecache, os
    from vllm.models.deepseek_v32 import attention
    path = inspect.getsourcefile(attention)
    lines = linecache.getlines(path)
    at = next(i for i, line in enumerate(lines) if line.startswith("class DeepseekV32Attention"))
    lines.insert(at + 1, "    # a point release's change\\n")
    stat = os.stat(path)
    linecache.cache[path] = (stat.st_size, stat.st_mtime, lines, path)
"""


def test_point_release_patched_seam_by_seam():
    same = run_python(CPU_DBO, POINT_RELEASE, REGISTER, LOAD_GLM5_STACK)
    assert "UNAPPLIED []" in same.stdout, same.stderr[-3000:]
    assert "LOADED False" in same.stdout and "LOADED True" in same.stdout

    changed = run_python(CPU_DBO, POINT_RELEASE, CHANGE_SEAM, REGISTER, LOAD_GLM5_STACK)
    assert "UNAPPLIED ['deepseek_v32_attention']" in changed.stdout, changed.stderr[-3000:]
    assert "LOADED False" in changed.stdout
    assert "REFUSED True vllm-dsa-dbo: Model shares top-k between layers" in changed.stdout
    assert "patch deepseek_v32_attention left unapplied: vllm.models.deepseek_v32.attention " in (
        changed.stderr
    )
    assert "differs from vLLM 0.3" in changed.stderr and "seam sha256" in changed.stderr


def test_failed_check_leaves_its_path_unwired_and_the_model_refused():
    from vllm_dsa_dbo.patches import fix_patches, matters

    dependent = sorted(p.name for p in fix_patches() if matters(p))
    wired = run_python(CPU_DBO, REGISTER, LOAD_GLM5_STACK)
    assert "UNAPPLIED []" in wired.stdout, wired.stderr[-3000:]
    assert "LOADED False" in wired.stdout and "LOADED True" in wired.stdout
    assert "keeps shared top-k per DBO microbatch: 2 microbatches" in wired.stderr

    broken = run_python(CPU_DBO, BREAK_REGISTRY, REGISTER, LOAD_GLM5_STACK)
    assert f"UNAPPLIED {dependent}" in broken.stdout, broken.stdout + broken.stderr[-3000:]
    assert "LOADED False" in broken.stdout
    assert "REFUSED True vllm-dsa-dbo: Model shares top-k between layers" in broken.stdout
    warnings = [line for line in broken.stderr.splitlines() if "left unapplied" in line]
    assert len(warnings) == len(dependent)
    registry = "index_group left unapplied: vllm.v1.worker.ubatching._THREAD_ID_TO_CONTEXT"
    assert any(registry in w for w in warnings)


def test_unwired_load_check_falls_back_to_the_guard():
    result = run_python(
        """
        from vllm.model_executor.model_loader import utils
        def initialize_model(config, *, prefix=""): ...
        utils.initialize_model = initialize_model
        """,
        REGISTER,
    )
    log = result.stderr + result.stdout
    assert "patch base_loader left unapplied" in log and "takes no vllm_config" in log, log[-3000:]
    assert "could not install its load-time check here" in log
    assert (
        "refused (guard at vllm.config.VllmConfig.__post_init__ and "
        "vllm.model_executor.model_loader.tensorizer.init_tensorizer_model)" in log
    )


# A second general plugin: vLLM imports it before any register(), it takes vLLM's getter
# then, and its register() re-installs its wrapper over ours.
SECOND_PLUGIN_IMPORT = """
    from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
    theirs = SharedTopkIndicesBuffer.topk_indices_buffer
"""
SECOND_PLUGIN_REGISTER = """
    SharedTopkIndicesBuffer.topk_indices_buffer = property(
        lambda self: theirs.fget(self), theirs.fset
    )
"""


def test_getter_replaced_after_register_is_refused_at_load():
    """The load check reads the top-k as a microbatch-1 thread does: a getter another plugin
    put back over the fix's resolves microbatch 0's buffer there, and DBO is refused."""
    result = run_python(
        CPU_DBO, SECOND_PLUGIN_IMPORT, REGISTER, SECOND_PLUGIN_REGISTER, LOAD_GLM5_STACK
    )
    out = result.stdout
    assert "UNAPPLIED []" in out and "LOADED False" in out, out + result.stderr[-3000:]
    assert "REFUSED True vllm-dsa-dbo: Model shares top-k between layers, but a microbatch-1 " in (
        out
    )
    assert (
        "microbatch 1 resolves microbatch 0's top-k at layers.0.impl, layers.0, layers.1.impl, "
        "layers.1, layers.2.impl, layers.2: other code replaces vllm.model_executor.layers."
        "attention.sparse_mla_attention.SharedTopkIndicesBuffer.topk_indices_buffer (by <lambda>"
        in out
    )


# A second plugin's register() takes the fix's property off DeepseekV32Attention: its leaders'
# writers then read a plain attribute again, microbatch 0's buffer in every microbatch.
SECOND_PLUGIN_PLAIN_BUFFER = """
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention
    del DeepseekV32Attention.topk_indices_buffer
"""


def test_leader_buffer_made_plain_after_register_is_refused_at_load():
    """The load check reads the buffer a leader's writers read, property or plain attribute."""
    result = run_python(CPU_DBO, REGISTER, SECOND_PLUGIN_PLAIN_BUFFER, LOAD_GLM5_STACK)
    out = result.stdout
    assert "LOADED False" in out, out + result.stderr[-3000:]
    assert "REFUSED True vllm-dsa-dbo: Model shares top-k between layers, but a microbatch-1 " in (
        out
    )
    assert "in microbatch 1, its layers' getters resolve different buffers" in out
