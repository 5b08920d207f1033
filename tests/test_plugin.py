"""Loading: vLLM finds the entry point, the guard refuses other versions,
registration is idempotent, HiSparse followers under DBO are refused."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from types import SimpleNamespace

import pytest
import torch

import fresh
from vllm_dsa_dbo import patches
from vllm_dsa_dbo.patches import NAMES, fix_patches, mistral_attention
from vllm_dsa_dbo.settings import is_supported_vllm


def run_python(*parts: str, **env: str) -> subprocess.CompletedProcess:
    code = "".join(textwrap.dedent(part) for part in parts)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return fresh.python(["-c", code], {**environ, **env}, timeout=300)


LOAD = """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
"""
PATCHED = """
    from vllm.v1.attention.backends.mla import index_group
    print("PATCHED", hasattr(index_group.SparseMLAIndexGroup, "_topk_state"))
"""


def test_vllm_loads_the_entry_point():
    result = run_python(LOAD, PATCHED)
    assert "PATCHED True" in result.stdout, result.stderr[-2000:]


def test_vllm_plugins_filter_and_env_switch_turn_it_off():
    assert "PATCHED False" in run_python(LOAD, PATCHED, VLLM_PLUGINS="other").stdout
    assert "PATCHED False" in run_python(LOAD, PATCHED, VLLM_DSA_DBO_DISABLE="1").stdout


MODEL_MODULES = """
    import importlib, json, sys
    from vllm_dsa_dbo import patches
    from vllm_dsa_dbo.diagnostics import isolation
    every = [*patches.fix_patches(), *isolation.PATCHES]
    targets = sorted({
        p.target for p in every
        if p.target.startswith(patches.MODEL_PACKAGES) and ".amd." not in p.target
        and patches.matters(p)
    })
    before = [t for t in targets if t in sys.modules]
    after = {t: patches.applied(importlib.import_module(t)) for t in targets}
    print("MODELS " + json.dumps({"imported_by_register": before, "patched_on_import": after}))
"""


def test_model_modules_are_patched_when_vllm_imports_them():
    """register() imports no model module: on CUDA that import initializes CUDA, and vLLM's
    engine core then spawns its workers instead of forking them. Each is patched as vLLM
    imports it, the isolation checker's patches after the fix's."""
    result = run_python(LOAD, MODEL_MODULES, VLLM_DSA_DBO_CHECK="audit")
    line = next((s for s in result.stdout.splitlines() if s.startswith("MODELS ")), None)
    assert line is not None, result.stderr[-3000:]
    found = json.loads(line.removeprefix("MODELS "))
    assert found["imported_by_register"] == []
    expected = {
        "vllm.models.deepseek_v32.attention": ["deepseek_v32_attention"],
        "vllm.models.deepseek_v41.attention": [
            "deepseek_v41_attention",
            "isolation_deepseek_v41_attention",
        ],
        "vllm.models.deepseek_v41.nvidia.model": ["deepseek_v41_model"],
        "vllm.models.hy_v4.nvidia.attention": ["hy_v4_attention"],
        "vllm.models.hy_v4.nvidia.model": ["hy_v4_model"],
    }
    if patches.matters(mistral_attention.PATCH):  # vLLM 0.34.0 on
        expected["vllm.models.mistral.nvidia.attention"] = ["mistral_attention"]
        expected["vllm.models.mistral.nvidia.indexer"] = ["mistral_indexer"]
    assert found["patched_on_import"] == expected


RECORD_LOG = """
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vllm.dsa_dbo").addHandler(handler)
"""
CHECKER = """
    from vllm_dsa_dbo.diagnostics import isolation
    print("CHECKER", isolation.CHECKER and isolation.CHECKER.mode)
    print("ERRORS", [r.getMessage() for r in records if r.levelname == "ERROR"])
"""


@pytest.mark.parametrize(
    "env, patched, checker, logged",
    [
        (
            {"VLLM_DSA_DBO_CHECK": "bogus"},
            True,
            None,
            "VLLM_DSA_DBO_CHECK='bogus' is not understood: set raise or audit to turn the checker "
            "on, or unset it (0, false, no, off or none also mean off). The isolation checker "
            "stays off.",
        ),
        (
            {"VLLM_DSA_DBO_DISABLE": "maybe"},
            True,
            None,
            "VLLM_DSA_DBO_DISABLE='maybe' is not understood: set 1, true, yes, on or stock to "
            "turn the fix off and refuse what it would fix (stock: run vLLM's stock, corrupted "
            "behaviour for A/B runs), or unset it (0, false, no, off or none also mean off). "
            "The fix is applied.",
        ),
        ({"VLLM_DSA_DBO_CHECK": "off", "VLLM_DSA_DBO_DISABLE": "0"}, True, None, None),
        ({"VLLM_DSA_DBO_CHECK": "Audit", "VLLM_DSA_DBO_DISABLE": "yes"}, False, "audit", None),
    ],
    ids=["check-bogus", "disable-maybe", "off-spellings", "checker-only"],
)
def test_vllm_starts_with_any_env_value(env, patched, checker, logged):
    """vLLM's plugin loader never sees an exception: an unknown value is logged as an
    error, the checker stays off and the fix is applied."""
    result = run_python(RECORD_LOG, LOAD, PATCHED, CHECKER, **env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"PATCHED {patched}" in result.stdout and f"CHECKER {checker}" in result.stdout
    expected = [] if logged is None else [f"vllm-dsa-dbo: {logged}"]
    assert f"ERRORS {expected!r}" in result.stdout, result.stdout


def test_the_retired_layout_switch_is_reported_and_read_no_more():
    result = run_python(
        RECORD_LOG,
        LOAD,
        PATCHED,
        """
        print("WARNINGS", [r.getMessage() for r in records if r.levelname == "WARNING"])
        """,
        VLLM_DSA_DBO_LAYOUT="copies",
    )
    assert "PATCHED True" in result.stdout, result.stderr[-3000:]
    notice = (
        "vllm-dsa-dbo: VLLM_DSA_DBO_LAYOUT='copies' is no longer read: microbatches 1.. always "
        "read microbatch 0's top-k buffers from their token offset."
    )
    assert f"WARNINGS {[notice]!r}" in result.stdout, result.stdout


def test_other_vllm_version_is_refused_and_nothing_patched():
    result = run_python(
        """
        import vllm
        vllm.__version__ = "0.35.0"
        import vllm_dsa_dbo
        vllm_dsa_dbo.register()
        """,
        PATCHED,
    )
    assert "PATCHED False" in result.stdout
    assert "supports vLLM 0.33.0 and 0.34.0 only, found 0.35.0" in result.stderr + result.stdout


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.33.0", True),
        ("0.33.0+cu130", True),
        ("0.34.0", True),
        # A point release is checked seam by seam against its series' release.
        ("0.34.2", True),
        ("0.35.0", False),
        ("0.34.0rc1", False),
        ("0.33.0.dev12", False),
        ("0.34.0.post1", False),
        ("not a version", False),
    ],
)
def test_version_guard(version, ok):
    assert is_supported_vllm(version) is ok


def test_register_twice_patches_once(vllm_env):
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SharedTopkIndicesBuffer,
    )
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    import vllm_dsa_dbo

    prop = SharedTopkIndicesBuffer.topk_indices_buffer
    init = SparseMLAIndexGroupBuilder.__init__
    vllm_dsa_dbo.register()
    assert SharedTopkIndicesBuffer.topk_indices_buffer is prop
    assert SparseMLAIndexGroupBuilder.__init__ is init


def test_every_patch_declares_its_header():
    records = fix_patches()
    assert sorted(p.name for p in records) == list(NAMES)
    targets = [p.target for p in records]
    assert len(set(targets)) == len(targets)
    for patch in records:
        for field in ("why", "how", "upstream", "remove_when"):
            assert getattr(patch, field).strip(), (patch.name, field)


def test_hisparse_follower_under_dbo_is_refused(fake_gpu):
    from vllm.v1.attention.backends.mla.index_group import (
        HiSparseMLAIndexGroup,
        SparseMLAIndexGroupBuilder,
    )

    buffer = torch.empty(16, 128, dtype=torch.int32)
    builder = SparseMLAIndexGroupBuilder(buffer, 4, num_ubatches=2)
    # A HiSparse leader group as register_layer builds it with a HiSparse config.
    builder.current_group = HiSparseMLAIndexGroup(
        logical_topk_indices=buffer,
        physical_topk_indices=torch.empty(5, 128, dtype=torch.int32),
        valid_topk_counts=torch.empty(5, dtype=torch.int32),
        side_stream=torch.Stream(),
        logical_topk_ready=torch.Event(),
        physical_topk_ready=torch.Event(),
        has_indexer=True,
        num_layers=1,
    )
    with pytest.raises(ValueError, match="HiSparse cannot run with dual batch overlap"):
        builder.register_layer(False)
    assert builder.current_group.num_layers == 1


def test_hisparse_under_dbo_is_refused_at_load_with_or_without_followers(vllm_env):
    """vLLM's HiSparse KV write takes the whole batch's slot mapping from row 0, not the
    microbatch's: microbatch 1 writes its KV into microbatch 0's slots, followers or
    not. Through vLLM's MLAAttention.update_kv_cache and HiSparseCacheHandle; the
    runtime (compiled kernels only) and the KV write kernel are stand-ins."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.hisparse.runtime import HiSparseCacheHandle

    from vllm_dsa_dbo.diagnostics.load_check import checked_build

    runtime = SimpleNamespace(
        kv_dtype=torch.bfloat16,
        row_width=8,
        max_num_reqs=4,
        eager_host_mirror=False,
        begin_forward=lambda: None,
        is_group_leader=True,
        max_swap_rows=8,  # read by vLLM 0.34.0's prepare
    )
    handle = HiSparseCacheHandle(runtime)
    batch_slots = torch.arange(100, 112)  # microbatch 0: tokens 0-5, microbatch 1: 6-11
    handle.bind_cache(
        torch.zeros(4 * 4 * 8 * 2, dtype=torch.uint8),
        byte_offset=0,
        block_stride=4 * 8 * 2,
        num_blocks=4,
        block_size=4,
        block_table=torch.zeros(4, 4, dtype=torch.int32),
        slot_mapping=batch_slots,
    )
    written = []
    layer = SimpleNamespace(
        hisparse_cache=handle,
        use_pcp=False,
        pcp_shard_decode_requests=False,
        _k_scale_float=1.0,
        impl=SimpleNamespace(
            do_kv_cache_update=lambda kv, pe, cache, slots, *a: written.append(slots)
        ),
    )
    ubatch1 = SimpleNamespace(
        num_actual_tokens=6,
        num_decode_tokens=0,
        max_query_len=6,
        num_reqs=1,
        req_id_per_token=torch.zeros(6, dtype=torch.int32),
    )
    handle.prepare_group_for_batch(ubatch1)  # as microbatch 1's leader layer does
    MLAAttention.update_kv_cache(
        layer,
        torch.zeros(6, 8),
        torch.zeros(6, 1, 8),
        None,
        batch_slots[6:],
        ubatch1,
        "auto",
        torch.ones(1),
    )
    assert written[0].tolist() == batch_slots[:6].tolist()  # microbatch 0's slots

    parallel = SimpleNamespace(enable_dbo=True, use_ubatching=True, num_ubatches=2)
    dbo = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=object()), parallel_config=parallel
    )
    build = checked_build(lambda vllm_config: torch.nn.Linear(1, 1))  # a model of no DSA layers
    with pytest.raises(ValueError, match="HiSparse cannot run with dual batch overlap, whatever"):
        build(vllm_config=dbo)


RELOAD = """
    import importlib, sys
    import vllm_dsa_dbo
    vllm_dsa_dbo.register()
    for name in [m for m in sys.modules if m.split(".")[0] == "vllm_dsa_dbo"]:
        del sys.modules[name]
    importlib.import_module("vllm_dsa_dbo").register()
    from vllm_dsa_dbo.patches import _on_import, applied
    from vllm.model_executor.model_loader import utils
    attention = importlib.import_module("vllm.models.deepseek_v32.attention")
    init = attention.DeepseekV32Attention.__init__
    print("FINDERS", sum(type(f).__name__ == "_Finder" for f in sys.meta_path))
    print("APPLIED", applied(attention), applied(utils))
    print("STACKED", hasattr(init.__wrapped__, "after_init"),
          utils.initialize_model.__wrapped__.__module__)
"""


def test_plugin_imported_twice_keeps_one_finder_and_model_imports_work():
    """A hot reload or a test harness imports the plugin's modules again: one finder stays,
    a model module imported afterwards is patched once, nothing is stacked."""
    from vllm.model_executor.model_loader import utils

    result = run_python(RELOAD)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FINDERS 1" in result.stdout, result.stdout
    assert "APPLIED ('deepseek_v32_attention',) ('base_loader',)" in result.stdout
    assert f"STACKED False {utils.__name__}" in result.stdout
