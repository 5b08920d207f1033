"""vLLM's own tests of what the plugin patches (DBO microbatch slicing
and threads, the naive DP/EP prepare/finalize under DBO, `sparse_attn_indexer`, the
sparse MLA impls' top-k buffer and index groups) give the same outcome, test by test,
with the plugin loaded as stock. Skipped, with the reason, where vLLM's sdist is
neither cached nor fetchable."""

from __future__ import annotations

from pathlib import Path

import pytest

import vllm_sdist

# Per release: 0.34.0 removed the TP prefill row sharding (PrefillRowShard) for ShardQ.
VLLM_TESTS = {
    "0.33.0": [
        "tests/v1/worker/test_ubatch_offsets.py",
        "tests/v1/worker/test_gpu_ubatch_slicing.py",
        "tests/kernels/moe/test_naive_dp_ep_dbo.py",
        "tests/v1/attention/test_indexer_tp_row_shard.py",
    ],
    "0.34.0": [
        "tests/v1/worker/test_ubatch_offsets.py",
        "tests/v1/worker/test_gpu_ubatch_slicing.py",
        "tests/kernels/moe/test_naive_dp_ep_dbo.py",
        "tests/v1/attention/test_shardq.py",
    ],
}


@pytest.fixture
def root() -> Path:
    """vLLM's tests from its sdist, run against the installed vLLM."""
    try:
        return vllm_sdist.extract_tests(vllm_sdist.fetch(), vllm_sdist.CACHE / "src")
    except vllm_sdist.SdistUnavailable as e:
        pytest.skip(f"vLLM's own tests not run: {e}")


def test_vllm_own_tests_pass_with_the_plugin_as_stock(root):
    runs = vllm_sdist.compare(root, VLLM_TESTS[vllm_sdist.VERSION], workers=2)
    (stock_summary, stock), (plugin_summary, plugin) = runs["stock"], runs["plugin"]
    assert plugin and " passed" in plugin_summary, plugin_summary
    assert "failed" not in plugin_summary and "error" not in plugin_summary, plugin_summary
    assert plugin == stock, (stock_summary, plugin_summary)


def test_vllm_sparse_mla_tests_pass_on_a_cpu_with_the_plugin_as_stock(root):
    """vLLM's tests of the sparse MLA impls and index groups the plugin patches skip
    themselves without a GPU: those that need none run from a CPU copy of their module."""
    runs = vllm_sdist.compare(root, vllm_sdist.sparse_mla_tests_on_cpu(root), workers=2)
    (stock_summary, stock), (plugin_summary, plugin) = runs["stock"], runs["plugin"]
    assert plugin == stock, (stock_summary, plugin_summary)
    passed = [test.rsplit("::", 1)[1] for test, outcome in plugin.items() if outcome == "passed"]
    assert set(plugin.values()) <= {"passed", "skipped"}, plugin_summary
    assert {
        *vllm_sdist.BARE_HISPARSE_TESTS,
        "test_explicit_topk_buffer_supersedes_indexer",
        "test_sparse_impl_observes_repointed_indexer_buffer",
        "test_sparse_mla_common_impl_resolves_buffer_lazily",
    } <= set(passed), plugin_summary
