"""The core test (and the HYV4, ROCm DSA, compiled DSA, sparse MLA backend and DeepSeek-V4.1
tests for their patches, and the loader, guard and live-check tests for theirs) fails when
any part of the fix is removed from the source; so does each bad-input test when its check is.

Each mutation edits a copy of the package and runs its test against it as a
fresh `python -m pytest` would (forked from an interpreter that imported torch
and vLLM but not the package: tests/forkserver.py), one mutation per test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import forkserver
import vllm_dsa_dbo

REPO = Path(__file__).resolve().parents[1]
CORE_TEST = "tests/test_core.py::test_dbo_ubatch_followers_read_their_own_leaders_topk"
HYV4_TEST = "tests/test_patch_hy_v4.py::test_hy_v4_followers_read_their_own_leaders_topk"
ROCM_TEST = "tests/test_patch_rocm_dsa.py::test_rocm_dsa_followers_read_their_own_leaders_topk"
COMPILED_TEST = "tests/test_patch_mla.py::test_compiled_dsa_followers_read_their_own_leaders_topk"
V41_TEST = (
    "tests/test_patch_deepseek_v41.py::test_deepseek_v41_reusing_layers_read_their_own_ubatch_state"
)
TRACED_TEST = "tests/test_patch_mla.py::test_traced_code_reads_microbatch_0s_group_state"
BACKENDS = "tests/test_sparse_mla_backends.py"
BACKEND_TEST = f"{BACKENDS}::test_followers_read_their_own_leaders_topk"
FA3_TEST = f"{BACKEND_TEST}[FLASH_ATTN_MLA_SPARSE-auto-decode-16h]"
FLASHMLA_FP8_TEST = f"{BACKEND_TEST}[FLASHMLA_SPARSE-fp8_ds_mla-mixed-16h]"
SM90_TEST = f"{BACKEND_TEST}[FLASHINFER_MLA_SPARSE_SM90-auto-mixed-16h]"
XPU_TEST = f"{BACKENDS}::test_xpu_followers_share_one_buffer_and_are_refused"
LOADER_TEST = (
    "tests/test_patch_base_loader.py::test_refused_model_is_refused_whichever_loader_builds_it"
)
ALIAS_TEST = (
    "tests/test_patch_base_loader.py::test_loaders_imported_before_registration_get_the_check"
)
GUARD_TEST = (
    "tests/test_guard.py::test_other_version_refuses_dbo_with_shared_topk_and_runs_the_rest"
)
# Bad input never crashes and never lies.
DEMO_RAISE_TEST = (
    "tests/test_isolation.py::test_raise_mode_stops_at_the_first_bad_read_on_stock_vllm"
)
REGISTER_ENV_TEST = "tests/test_plugin.py::test_vllm_starts_with_any_env_value[check-bogus]"
STATUS_ENV_TEST = "tests/test_cli.py::test_status_unknown_env_value_is_an_error[check-bogus]"
BAD_CONFIG = "tests/test_cli.py::test_memory_bad_config"
MEMORY_HYV4_TEST = "tests/test_memory.py::test_memory_is_what_hy_v4_allocates"
MEMORY_ARCH_TEST = "tests/test_cli.py::test_memory_command_follows_the_architecture"
MEMORY_V41_TEST = f"{MEMORY_ARCH_TEST}[deepseek-v41]"
MEMORY_V41_ROCM_TEST = f"{MEMORY_ARCH_TEST}[deepseek-v41-rocm]"
MEMORY_BUILT_TEST = "tests/test_cli.py::test_memory_follows_the_architecture_vllm_builds"
AB_QUESTIONS_TEST = "tests/test_ab.py::test_runs_on_other_questions_are_refused"
AB_TWO_RUNS_TEST = "tests/test_ab.py::test_a_folder_with_two_runs_is_refused"
UPSTREAM = "tests/test_upstream_patch.py"
UPSTREAM_TEST = f"{UPSTREAM}::test_new_test_passes_in_the_patched_tree"
UPSTREAM_CODE_TEST = (
    f"{UPSTREAM}::test_model_passes_the_microbatch_count_and_writers_take_the_impls_buffer"
)
UPSTREAM_HOOKS_TEST = f"{UPSTREAM}::test_patched_tree_passes_vllms_hooks_and_adds_no_mypy_error"
UPSTREAM_REFUSAL_TEST = (
    f"{UPSTREAM}::test_tree_the_change_does_not_fit_is_refused_and_nothing_written"
    "[changed context line]"
)
UPSTREAM_VERSION_TEST = (
    f"{UPSTREAM}::test_tree_the_change_does_not_fit_is_refused_and_nothing_written[another version]"
)
UPSTREAM_DRY_RUN_TEST = f"{UPSTREAM}::test_diff_applies_with_git_and_dry_run_writes_nothing"
TREE_TEST = f"{UPSTREAM}::test_plugin_in_a_patched_tree_retires_only_what_the_tree_carries"
RECORDS_TEST = "tests/test_patch_records.py::test_every_patch_lists_what_it_sets"
MODEL_MODULES_TEST = "tests/test_plugin.py::test_model_modules_are_patched_when_vllm_imports_them"

MUTATIONS = {
    "index group always returns microbatch 0's state": (
        "core.py",
        "            if ubatch_id and group.ubatch_topk_states:\n",
        "            if False:\n",
        CORE_TEST,
    ),
    "model modules imported at registration": (
        "patches/__init__.py",
        "        if patch.target.startswith(MODEL_PACKAGES):\n",
        "        if False:\n",
        MODEL_MODULES_TEST,
    ),
    "a model module imported later is never patched": (
        "patches/_on_import.py",
        "        for callback in self._finder.pending.pop(module.__name__, ()):\n",
        "        for callback in ():\n",
        MODEL_MODULES_TEST,
    ),
    "impl not wired to the per-microbatch logical buffers": (
        "patches/sparse_mla_attention.py",
        '    return resolve_logical_topk(getattr(self, "index_group", None), buffer)\n',
        "    return buffer\n",
        CORE_TEST,
    ),
    "leader layers never mark their group wired": (
        "patches/deepseek_v32_attention.py",
        "    call_after_init(target.DeepseekV32Attention, mark_wired)\n",
        "    pass\n",
        CORE_TEST,
    ),
    "a patch sets a symbol its record does not list": (
        "patches/mla.py",
        '    replaces=("MultiHeadLatentAttentionWrapper.__init__",),\n',
        '    replaces=("MultiHeadLatentAttentionWrapper.forward",),\n',
        RECORDS_TEST,
    ),
    "leader's writers not wired to the impl's buffer": (
        "patches/deepseek_v32_attention.py",
        "    target.DeepseekV32Attention.topk_indices_buffer = property(_get, _set)\n",
        "    pass\n",
        CORE_TEST,
    ),
    "HYV4 indexer op left as vLLM's": (
        "patches/hy_v4_attention.py",
        "    target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)\n",
        "    pass\n",
        HYV4_TEST,
    ),
    "HYV4 model not wired": (
        "patches/hy_v4_model.py",
        "    call_after_init(target.HYV4Model, keep_logical_topk_per_ubatch)\n",
        "        pass\n",
        HYV4_TEST,
    ),
    "indexer op writes microbatch 0's buffer (HYV4)": (
        "core.py",
        "            return resolve_logical_topk(self.index_group, self._topk_indices_buffer)\n",
        "            return self._topk_indices_buffer\n",
        HYV4_TEST,
    ),
    "ROCm DSA indexer op left as vLLM's": (
        "patches/rocm_dsa_attention.py",
        "    target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)\n",
        "    pass\n",
        ROCM_TEST,
    ),
    "ROCm DSA model not wired": (
        "patches/rocm_dsa_model.py",
        "    call_after_init(target.DeepseekV32Model, keep_logical_topk_per_ubatch)\n",
        "        pass\n",
        ROCM_TEST,
    ),
    "leaders' indexer ops not given their group (ROCm DSA)": (
        "core.py",
        "        op.index_group = group\n",
        "        pass\n",
        ROCM_TEST,
    ),
    "indexer op writes microbatch 0's buffer (ROCm DSA)": (
        "core.py",
        "            return resolve_logical_topk(self.index_group, self._topk_indices_buffer)\n",
        "            return self._topk_indices_buffer\n",
        ROCM_TEST,
    ),
    "indexer op body left as vLLM's (compiled DSA)": (
        "patches/sparse_attn_indexer.py",
        "    cell.cell_contents = per_ubatch_indexer_kernel(cell.cell_contents)\n",
        "    pass\n",
        COMPILED_TEST,
    ),
    "indexer op body writes microbatch 0's buffer (compiled DSA)": (
        "patches/sparse_attn_indexer.py",
        "        if _UBATCH_ID_OF_THREAD and INDEXER_OP_LEADERS:\n",
        "        if False:\n",
        COMPILED_TEST,
    ),
    "compiled DSA layers not wired": (
        "patches/mla.py",
        "    call_after_init(target.MultiHeadLatentAttentionWrapper, wire)\n",
        "    pass\n",
        COMPILED_TEST,
    ),
    "traced code looks the microbatch up (graph break under fullgraph)": (
        "core.py",
        "        if _UBATCH_ID_OF_THREAD and not is_dynamo_compiling():\n",
        "        if _UBATCH_ID_OF_THREAD:\n",
        TRACED_TEST,
    ),
    "extra microbatches wait on their own, never-recorded event (compiled DSA)": (
        "patches/mla.py",
        "        state.logical_topk_ready = group.logical_topk_ready\n",
        "        pass\n",
        COMPILED_TEST,
    ),
    "model not wired (DSv41)": (
        "patches/deepseek_v41_model.py",
        "    call_after_init(target.DeepseekV4Model, keep_index_state_per_ubatch)\n",
        "    pass\n",
        V41_TEST,
    ),
    "candidate blocks get no copies (DSv41)": (
        "patches/deepseek_v41_model.py",
        "        buffers.append(model.candidate_block_buffer)\n",
        "        pass\n",
        V41_TEST,
    ),
    "buffers always resolve to microbatch 0's (DSv41)": (
        "ubatch_buffers.py",
        "    return buffer if entry is None else entry[1][ubatch_id - 1]\n",
        "    return buffer\n",
        V41_TEST,
    ),
    "attention layers read vLLM's buffers (DSv41)": (
        "patches/deepseek_v41_attention.py",
        "    per_ubatch_buffers(target.DeepseekV4Attention, "
        '"topk_indices_buffer", "candidate_block_buffer")\n',
        "    pass\n",
        V41_TEST,
    ),
    "indexer op writes vLLM's top-k buffer (DSv41)": (
        "patches/deepseek_v41_attention.py",
        "    indexer.attn_cls = per_ubatch_op(indexer.attn_cls)\n",
        "    pass\n",
        V41_TEST,
    ),
    "indexer op reads vLLM's candidate blocks (DSv41)": (
        "patches/deepseek_v41_attention.py",
        'OP_BUFFERS = ("topk_indices_buffer", "candidate_blocks")\n',
        'OP_BUFFERS = ("topk_indices_buffer",)\n',
        V41_TEST,
    ),
    "index group always returns microbatch 0's state (FLASH_ATTN_MLA_SPARSE)": (
        "core.py",
        "            if ubatch_id and group.ubatch_topk_states:\n",
        "            if False:\n",
        FA3_TEST,
    ),
    "leader's writers not wired to the impl's buffer (FLASHMLA_SPARSE fp8)": (
        "patches/deepseek_v32_attention.py",
        "    target.DeepseekV32Attention.topk_indices_buffer = property(_get, _set)\n",
        "    pass\n",
        FLASHMLA_FP8_TEST,
    ),
    "impl not wired to the per-microbatch logical buffers (FLASHINFER_MLA_SPARSE_SM90)": (
        "patches/sparse_mla_attention.py",
        '    return resolve_logical_topk(getattr(self, "index_group", None), buffer)\n',
        "    return buffer\n",
        SM90_TEST,
    ),
    "followers without an index group loaded under DBO (XPU_MLA_SPARSE)": (
        "diagnostics/refusals.py",
        "        ungrouped := [m for m in model.modules() if reads_topk_without_index_group(m)]\n",
        "        ungrouped := []\n",
        XPU_TEST,
    ),
    "only base_loader's alias of initialize_model checked (IPC loader)": (
        "diagnostics/load_check.py",
        '    apply=_checking("initialize_model"),\n',
        "    apply=lambda target: setattr(__import__(target.__name__.replace('utils', "
        "'base_loader'), fromlist=['x']), 'initialize_model', "
        "checked_build(target.initialize_model)),\n",
        f"{LOADER_TEST}[ipc_cache]",
    ),
    "vLLM-tensorized models built unchecked": (
        "diagnostics/load_check.py",
        '    apply=_checking("init_tensorizer_model"),\n',
        "    apply=lambda target: None,\n",
        f"{LOADER_TEST}[tensorizer_vllm_tensorized]",
    ),
    "modules that imported a build function before registration keep vLLM's": (
        "patches/_shared.py",
        '        if getattr(holder, "__dict__", {}).get(name) is stock:\n',
        "        if False:\n",
        ALIAS_TEST,
    ),
    "other vLLM versions refuse nothing": (
        "guard.py",
        "        refuse_unfixed(self, why)\n",
        "        pass\n",
        GUARD_TEST,
    ),
    "the patches a vLLM carries applied over its own": (
        "patches/__init__.py",
        "    carried = patch.in_tree(target)\n",
        "    carried = None\n",
        TREE_TEST,
    ),
    "the guard checks at config creation only": (
        "guard.py",
        "        put(why)\n",
        "        put(why)\n        break\n",
        "tests/test_guard.py::"
        "test_other_version_refuses_at_model_build_a_config_made_before_register",
    ),
    "MiniMax-M3's use_index_cache not matched by the guard": (
        "guard.py",
        "        return [SHARING_KEYS[-1]]\n",
        "        return []\n",
        "tests/test_guard.py::test_guard_refuses_minimax_m3_with_index_cache",
    ),
    "the off switch refuses nothing": (
        "__init__.py",
        "    if mode == REFUSE:\n",
        "    if False:\n",
        "tests/test_guard.py::"
        "test_off_switch_keeps_the_refusals_and_stock_is_explicit[off-keeps-refusals]",
    ),
    "HiSparse under DBO loaded": (
        "diagnostics/load_check.py",
        "            refuse_hisparse(vllm_config)\n",
        "            pass\n",
        "tests/test_plugin.py::test_hisparse_under_dbo_is_refused_at_load_whatever_the_layout",
    ),
    "thread registry not checked": (
        "patches/index_group.py",
        "    return core.thread_registry_mismatch() or "
        "builder_mismatch(target.SparseMLAIndexGroupBuilder)\n",
        "    return builder_mismatch(target.SparseMLAIndexGroupBuilder)\n",
        "tests/test_live_checks.py::test_thread_registry_check[registry_rebound]",
    ),
    "index-group builder signature not checked": (
        "patches/index_group.py",
        "        if found[: len(names)] != names:\n",
        "        if False:\n",
        "tests/test_live_checks.py::test_builder_signature_check",
    ),
    "indexer op body's cell not checked": (
        "patches/sparse_attn_indexer.py",
        '    if kernel is not getattr(op_body, "__wrapped__", None):\n',
        "    if False:\n",
        "tests/test_live_checks.py::test_op_body_check[other_cell]",
    ),
    "DeepSeek-V4.1 buffers without copies loaded under DBO (ROCm)": (
        "diagnostics/refusals.py",
        "    if reuses_topk(module) and not ubatch_copies(stored_buffer(module, "
        '"topk_indices_buffer")):\n        return True\n',
        "",
        "tests/test_cross_layer_refusal.py::"
        "test_cross_layer_topk_outside_index_groups_refused_under_dbo[deepseek_v41 index sharing]",
    ),
    "DeepSeek-V4.1 indexers without a candidate buffer counted as readers": (
        "patches/deepseek_v41_model.py",
        "    candidates = candidate_source >= 0 and "
        'getattr(config, "candidate_topk_blocks", 0) > 0\n',
        "    candidates = candidate_source >= 0\n",
        "tests/test_memory.py::test_memory_follows_the_architecture[v41-no-candidate-blocks]",
    ),
    "DeepSeek-V4.1 indexer ops' buffers not checked": (
        "patches/deepseek_v41_attention.py",
        "        or next(filter(None, (unset_attributes(op.__init__, *OP_BUFFERS) "
        "for op in ops)), None)\n",
        "        or None\n",
        "tests/test_live_checks.py::test_deepseek_v41_attention_check",
    ),
    "a torch.compile'd DeepSeek-V4.1 model patched anyway": (
        "patches/deepseek_v41_model.py",
        "    if issubclass(model, TorchCompileWithNoGuardsWrapper):\n",
        "    if False:\n",
        "tests/test_live_checks.py::test_deepseek_v41_model_check",
    ),
    "patches applied without the patches they need": (
        "patches/__init__.py",
        '    needs = [f"{r}, left unapplied" for r in patch.requires if known[r] is not None]\n',
        "    needs = []\n",
        "tests/test_patch_rocm_dsa.py::"
        "test_rocm_patches_skipped_off_rocm_when_their_module_cannot_import",
    ),
    "groups built for fewer microbatches than the run not refused": (
        "diagnostics/refusals.py",
        '    if getattr(group, "num_ubatches", 1) < num_ubatches:\n',
        '    if not hasattr(group, "num_ubatches"):\n',
        "tests/test_live_checks.py::"
        "test_groups_built_for_fewer_microbatches_than_the_run_are_refused",
    ),
    "demo: the checker's raise ends the stock phase with a traceback": (
        "demo.py",
        "        except isolation.MicrobatchIsolationError as e:\n",
        "        except KeyError as e:\n",
        DEMO_RAISE_TEST,
    ),
    "register raises on an unknown VLLM_DSA_DBO_CHECK": (
        "__init__.py",
        '        logger.error("vllm-dsa-dbo: %s. The isolation checker stays off.", e)\n'
        "        check = None\n",
        "        raise\n",
        REGISTER_ENV_TEST,
    ),
    "status passes over an unknown VLLM_DSA_DBO_CHECK": (
        "cli.py",
        '        errors.append(f"{e}; vLLM logs this and runs with the checker off")\n',
        "        pass\n",
        STATUS_ENV_TEST,
    ),
    "the checker counts a read outside a forward as a hand-off": (
        "diagnostics/isolation.py",
        "        if reader.step is None:\n            return\n",
        "",
        "tests/test_isolation.py::test_a_read_outside_a_forward_is_not_a_hand_off",
    ),
    "memory imports torch before it reads the config": (
        "cli.py",
        "    source, model = load_config(args)\n",
        "    import torch  # noqa: F401\n    source, model = load_config(args)\n",
        f"{BAD_CONFIG}[missing]",
    ),
    "memory leaves a string index_topk_freq to vLLM": (
        "diagnostics/layout.py",
        '        _whole(text, "index_topk_freq", 1, 1)\n',
        "        pass\n",
        f'{BAD_CONFIG}["index_topk_freq": "4"]',
    ),
    "memory sizes any architecture with index_topk": (
        "diagnostics/layout.py",
        "    if model_class not in CODE_PATHS:\n",
        "    if False:\n",
        f"{MEMORY_BUILT_TEST}[not-dsa]",
    ),
    "memory counts physical copies HYV4 does not make": (
        "cli.py",
        "        logical_only=model.path.copies == LOGICAL,\n",
        "        logical_only=False,\n",
        MEMORY_HYV4_TEST,
    ),
    "memory sizes DeepSeek-V4.1 on ROCm, which the loader refuses under DBO": (
        "diagnostics/layout.py",
        '        "rocm": CodePath("vllm/models/deepseek_v41/amd", "deepseek_v41", REFUSED),\n',
        '        "rocm": CodePath("vllm/models/deepseek_v41/amd", "deepseek_v41", MODEL_WIDE),\n',
        MEMORY_V41_ROCM_TEST,
    ),
    "memory leaves out DeepSeek-V4.1's copies": (
        "cli.py",
        "    ) + sum(tokens * columns * 4 for _, columns in model.buffers)\n",
        "    )\n",
        MEMORY_V41_TEST,
    ),
    "ab compares runs on other questions": (
        "ab.py",
        "        check_same_questions(ref, run)\n",
        "        pass\n",
        AB_QUESTIONS_TEST,
    ),
    "ab merges two runs' samples files": (
        "ab.py",
        "    if len(files) > 1:\n",
        "    if False:\n",
        AB_TWO_RUNS_TEST,
    ),
    "upstream change resolves no microbatch's physical top-k": (
        "upstream/change.py",
        "        return self.ubatch_topk[dbo_current_ubatch_id()]\n",
        "        return self\n",
        UPSTREAM_TEST,
    ),
    "upstream change leaves the impl's buffer getter as vLLM's": (
        "upstream/change.py",
        "        return group.ubatch_logical_topk_indices(buffer)\n",
        "        return buffer\n",
        UPSTREAM_TEST,
    ),
    "upstream change builds the model with one microbatch": (
        "upstream/change.py",
        "            get_num_ubatches(vllm_config.parallel_config),\n",
        "",
        UPSTREAM_CODE_TEST,
    ),
    "upstream change adds a mypy error": (
        "upstream/change.py",
        "                self.impl.topk_indices_buffer,  # type: ignore[attr-defined]\n",
        "                self.impl.topk_indices_buffer,\n",
        UPSTREAM_HOOKS_TEST,
    ),
    "upstream change calls torch.cuda": (
        "upstream/change.py",
        "        group.set_logical_topk_ready(leader_index)\n",
        "        group.set_logical_topk_ready(leader_index)\n        torch.cuda.synchronize()\n",
        UPSTREAM_HOOKS_TEST,
    ),
    "upstream-patch patches a statement that differs from 0.33.0's": (
        "upstream/__init__.py",
        "    if differ:\n",
        "    if False:\n",
        UPSTREAM_REFUSAL_TEST,
    ),
    "upstream-patch patches another version": (
        "upstream/__init__.py",
        "    if version != VERSION:\n",
        "    if False:\n",
        UPSTREAM_VERSION_TEST,
    ),
    "upstream-patch exits 0 on a tree it refuses": (
        "cli.py",
        '        raise UsageError(f"cannot patch {src}: {e}; nothing written") from None\n',
        "        return 0\n",
        UPSTREAM_REFUSAL_TEST,
    ),
    "upstream-patch --dry-run writes": (
        "cli.py",
        "    if args.dry_run:\n        return 0\n",
        "    if False:\n        return 0\n",
        UPSTREAM_DRY_RUN_TEST,
    ),
}


def run_test(package_root: Path, test: str = CORE_TEST) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    return forkserver.python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", test], env, cwd=REPO
    )


def copy_package(root: Path) -> Path:
    copy = root / "vllm_dsa_dbo"
    shutil.copytree(Path(vllm_dsa_dbo.__file__).parent, copy)
    return copy


@pytest.mark.parametrize(
    "test",
    [
        CORE_TEST,
        HYV4_TEST,
        ROCM_TEST,
        COMPILED_TEST,
        FA3_TEST,
        XPU_TEST,
        V41_TEST,
        DEMO_RAISE_TEST,
        REGISTER_ENV_TEST,
        STATUS_ENV_TEST,
        f"{MEMORY_BUILT_TEST}[not-dsa]",
        MEMORY_HYV4_TEST,
        MEMORY_V41_TEST,
        AB_QUESTIONS_TEST,
        AB_TWO_RUNS_TEST,
        RECORDS_TEST,
        MODEL_MODULES_TEST,
        UPSTREAM_TEST,
        UPSTREAM_CODE_TEST,
        UPSTREAM_HOOKS_TEST,
        UPSTREAM_REFUSAL_TEST,
        UPSTREAM_VERSION_TEST,
        UPSTREAM_DRY_RUN_TEST,
        TREE_TEST,
    ],
    ids=str,
)
def test_core_test_passes_on_unmutated_copy(test, tmp_path):
    copy_package(tmp_path)
    result = run_test(tmp_path, test)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def run_mutated(name: str, root: Path) -> subprocess.CompletedProcess | None:
    """The mutation's test on a mutated copy under `root`; None if its site moved."""
    path, old, new, test = MUTATIONS[name]
    target = copy_package(root) / path
    source = target.read_text()
    if source.count(old) != 1:
        return None
    target.write_text(source.replace(old, new))
    return run_test(root, test)


@pytest.mark.parametrize("name", MUTATIONS)
def test_core_test_fails_under_mutation(name, tmp_path):
    result = run_mutated(name, tmp_path)
    assert result is not None, f"mutation site for {name!r} moved"
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "AssertionError" in result.stdout or "DID NOT RAISE" in result.stdout
    assert "1 failed" in result.stdout
