"""The core test (and the HYV4, ROCm DSA, compiled DSA, sparse MLA backend and DeepSeek-V4.1
tests for their patches, and the loader, guard and live-check tests for theirs) fails when
any part of the fix is removed from the source; so does each bad-input test when its check is.

A mutation names what it takes out by structure, never by source text, so that no reformat
moves it:
- `skip(patch, test)`: the patch module's `apply` does nothing (its `Patch` record stays);
- `edit("module:qualified.name", old, new, test)`: at that function or class of the package
  (the whole module without a name), the statements or the expression `old` become `new`, both
  matched as syntax trees; with `old` None, the whole body becomes `new`;
- `text(module, old, new, test)`: `old` replaced in the module's one string literal that holds
  it (the upstream change is vLLM's source text, written as strings).
Each mutation edits a copy of the package and runs its test against it in a fresh interpreter
(tests/fresh.py), one mutation per test.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import fresh
import vllm_dsa_dbo
import vllm_sdist
from vllm_dsa_dbo import patches
from vllm_dsa_dbo.patches import mistral_attention

REPO = Path(__file__).resolve().parents[1]
CORE_TEST = "tests/test_core.py::test_dbo_ubatch_followers_read_their_own_leaders_topk"
PAST_WORKSPACE_TEST = (
    "tests/test_core.py::test_dbo_ubatch_past_the_workspace_converts_per_layer[True]"
)
HYV4_TEST = "tests/test_patch_hy_v4.py::test_hy_v4_followers_read_their_own_leaders_topk"
ROCM_TEST = "tests/test_patch_rocm_dsa.py::test_rocm_dsa_followers_read_their_own_leaders_topk"
COMPILED_TEST = "tests/test_patch_mla.py::test_compiled_dsa_followers_read_their_own_leaders_topk"
V41_TEST = (
    "tests/test_patch_deepseek_v41.py::test_deepseek_v41_reusing_layers_read_their_own_ubatch_state"
)
TRACED_TEST = "tests/test_patch_mla.py::test_traced_code_reads_microbatch_0s_group_state"
UNSET_FIELD_TEST = "tests/test_core.py::test_dbo_ubatch_group_built_without_init_reads_as_stock"
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
GUARD = "tests/test_guard.py"
GUARD_TEST = f"{GUARD}::test_other_version_refuses_dbo_with_shared_topk_and_runs_the_rest"
LIVE = "tests/test_live_checks.py"
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
# The installed release's change, the data upstream-patch writes in its trees.
UPSTREAM_CHANGE = f"upstream.change_{vllm_sdist.VERSION.replace('.', '_')}"
UPSTREAM_CODE_TEST = f"{UPSTREAM}::test_models_pass_the_microbatch_count"
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
WRAPPED_GETTER_TEST = (
    "tests/test_patch_base_loader.py::test_a_wrapper_over_a_patched_getter_is_named_at_load"
)
LEFT_OUT_TEST = (
    "tests/test_upstream_tree_load.py::"
    "test_the_paths_the_change_leaves_out_stay_fixed_on_the_trees_state"
)
PARTIAL_TREE_TEST = (
    "tests/test_upstream_tree_load.py::"
    "test_a_tree_that_carries_the_change_in_part_fixes_glm5_or_refuses_it_naming_the_rest"
)
RECORDS_TEST = "tests/test_patch_records.py::test_every_patch_lists_what_it_sets"
MODEL_MODULES_TEST = "tests/test_plugin.py::test_model_modules_are_patched_when_vllm_imports_them"


@dataclass(frozen=True)
class Mutation:
    site: str  # "module:qualified.name" under the package ("__init__" its own); no name: all
    old: str | None  # None: the whole body at the site
    new: str
    test: str  # the test it fails
    in_string: bool = False

    @property
    def path(self) -> str:
        """The module's file, under the package."""
        module = self.site.partition(":")[0].replace(".", "/")
        package = Path(vllm_dsa_dbo.__file__).parent
        return f"{module}/__init__.py" if (package / module).is_dir() else f"{module}.py"

    def apply(self, source: str) -> str:
        tree = ast.parse(source)
        where = self.site.partition(":")[2]
        if self.in_string:
            found = _replace_text(tree, self.old, self.new)
        elif self.old is None:
            scopes = _scopes(tree, where)
            for scope in scopes:
                scope.body = ast.parse(self.new).body
            found = len(scopes)
        else:
            found = sum(_replace(scope, self.old, self.new) for scope in _scopes(tree, where))
        if found != 1:
            raise LookupError(f"{self} matches {found} times in {self.path}, not once")
        return ast.unparse(ast.fix_missing_locations(tree))


def skip(patch: str, test: str) -> Mutation:
    """The patch's `apply` does nothing."""
    return Mutation(f"patches.{patch}:apply", None, "pass", test)


def edit(site: str, old: str | None, new: str, test: str) -> Mutation:
    return Mutation(site, old, new, test)


def text(module: str, old: str, new: str, test: str) -> Mutation:
    return Mutation(module, old, new, test, in_string=True)


def _scopes(tree: ast.Module, where: str) -> list[ast.AST]:
    """The functions and classes named `where` (a getter and its setter share a name)."""
    if not where:
        return [tree]
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                if name == where:
                    found.append(child)
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def _expression(code: str) -> ast.expr | None:
    try:
        return ast.parse(code, mode="eval").body
    except SyntaxError:
        return None


def _keyword(body: list[ast.stmt]) -> tuple[str, ast.expr] | None:
    """`name=value` parsed as a statement, as a call's keyword argument."""
    if len(body) == 1 and isinstance(body[0], ast.Assign) and len(body[0].targets) == 1:
        target = body[0].targets[0]
        return (target.id, body[0].value) if isinstance(target, ast.Name) else None
    return None


def _replace(scope: ast.AST, old: str, new: str) -> int:
    """Each `old` under `scope` replaced by `new`, as expressions if both are, as keyword
    arguments if both are `name=value`, else as runs of statements; how many were."""
    same = lambda a, b: ast.dump(a) == ast.dump(b)  # noqa: E731
    old_expr, new_expr = _expression(old), _expression(new)
    old_body, new_body = ast.parse(old).body, ast.parse(new).body
    old_arg, new_arg = _keyword(old_body), _keyword(new_body)
    count = 0
    for node in ast.walk(scope):
        for field, value in ast.iter_fields(node):
            if old_expr is not None and new_expr is not None:
                if isinstance(value, ast.expr) and same(value, old_expr):
                    setattr(node, field, new_expr)
                    count += 1
                for i, item in enumerate(value if isinstance(value, list) else ()):
                    if isinstance(item, ast.expr) and same(item, old_expr):
                        value[i] = new_expr
                        count += 1
                continue
            if old_arg and new_arg and isinstance(node, ast.keyword) and field == "arg":
                if value == old_arg[0] and same(node.value, old_arg[1]):
                    node.arg, node.value = new_arg
                    count += 1
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                i = 0
                while i + len(old_body) <= len(value):
                    if all(map(same, value[i : i + len(old_body)], old_body)):
                        value[i : i + len(old_body)] = new_body
                        i += len(new_body)
                        count += 1
                    else:
                        i += 1
                value[:] = value or [ast.Pass()]
    return count


def _replace_text(tree: ast.Module, old: str, new: str) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            count += node.value.count(old)
            node.value = node.value.replace(old, new)
    return count


MUTATIONS = {
    "index group always returns microbatch 0's state": edit(
        "core:UbatchTopkField.__get__", "ubatch_id and group.ubatch_topk_states", "False", CORE_TEST
    ),
    "an unset group field raises KeyError, not AttributeError": edit(
        "core:UbatchTopkField.__get__",
        """try:
    return group.__dict__[self.slot]
except KeyError:
    raise AttributeError(
        f"{type(group).__name__!r} object has no attribute {self.name!r}"
    ) from None""",
        "return group.__dict__[self.slot]",
        UNSET_FIELD_TEST,
    ),
    "a follower's logical top-k resolves to microbatch 0's buffer": edit(
        "core:resolve_logical_topk", None, "return buffer", CORE_TEST
    ),
    "the builder gives groups with followers no per-microbatch state": edit(
        "core:add_layer_state", "layer_index == 1 and builder.num_ubatches > 1", "False", CORE_TEST
    ),
    "model modules imported at registration": edit(
        "patches:apply_all",
        "patch.target.startswith(MODEL_PACKAGES)",
        "False",
        MODEL_MODULES_TEST,
    ),
    "a model module imported later is never patched": edit(
        "patches._on_import:_Loader.exec_module",
        "self._finder.pending.pop(module.__name__, ())",
        "()",
        MODEL_MODULES_TEST,
    ),
    "impl not wired to the per-microbatch logical buffers": edit(
        "patches.sparse_mla_attention:topk_indices_buffer",
        'return resolve_logical_topk(getattr(self, "index_group", None), buffer)',
        "return buffer",
        CORE_TEST,
    ),
    "leader layers never mark their group wired": edit(
        "patches.deepseek_v32_attention:apply",
        "call_after_init(target.DeepseekV32Attention, mark_wired)",
        "pass",
        CORE_TEST,
    ),
    "a patch sets a symbol its record does not list": edit(
        "patches.mla",
        '("MultiHeadLatentAttentionWrapper.__init__",)',
        '("MultiHeadLatentAttentionWrapper.forward",)',
        RECORDS_TEST,
    ),
    "leader's writers not wired to the impl's buffer": edit(
        "patches.deepseek_v32_attention:apply",
        "target.DeepseekV32Attention.topk_indices_buffer = IMPL_TOPK_INDICES_BUFFER",
        "pass",
        CORE_TEST,
    ),
    "HYV4 indexer op left as vLLM's": skip("hy_v4_attention", HYV4_TEST),
    "HYV4 model not wired": skip("hy_v4_model", HYV4_TEST),
    "indexer op writes microbatch 0's buffer (HYV4)": edit(
        "core:per_ubatch_indexer_op.IndexerOp.topk_indices_buffer",
        "resolve_logical_topk(self.index_group, self._topk_indices_buffer)",
        "self._topk_indices_buffer",
        HYV4_TEST,
    ),
    "ROCm DSA indexer op left as vLLM's": skip("rocm_dsa_attention", ROCM_TEST),
    "ROCm DSA model not wired": skip("rocm_dsa_model", ROCM_TEST),
    "leaders' indexer ops not given their group (ROCm DSA)": edit(
        "core:share_ubatch_logical_topk",
        "op.index_group = group",
        "pass",
        ROCM_TEST,
    ),
    "indexer op writes microbatch 0's buffer (ROCm DSA)": edit(
        "core:per_ubatch_indexer_op.IndexerOp.topk_indices_buffer",
        "resolve_logical_topk(self.index_group, self._topk_indices_buffer)",
        "self._topk_indices_buffer",
        ROCM_TEST,
    ),
    "indexer op body left as vLLM's (compiled DSA)": skip("sparse_attn_indexer", COMPILED_TEST),
    "indexer op body writes microbatch 0's buffer (compiled DSA)": edit(
        "patches.sparse_attn_indexer:per_ubatch_indexer_kernel.per_ubatch_kernel",
        "INDEXER_OP_LEADERS and current_ubatch_id()",
        "False",
        COMPILED_TEST,
    ),
    "compiled DSA layers not wired": skip("mla", COMPILED_TEST),
    "traced code looks the microbatch up (graph break under fullgraph)": edit(
        "core:current_ubatch_id",
        "not _UBATCH_ID_OF_THREAD or is_dynamo_compiling()",
        "not _UBATCH_ID_OF_THREAD",
        TRACED_TEST,
    ),
    "extra microbatches wait on their own, never-recorded event (compiled DSA)": edit(
        "patches.mla:share_logical_topk_ready",
        "state.logical_topk_ready = group.logical_topk_ready",
        "pass",
        COMPILED_TEST,
    ),
    "model not wired (DSv41)": skip("deepseek_v41_model", V41_TEST),
    "candidate blocks get no copies (DSv41)": edit(
        "patches.deepseek_v41_model:handed_off_buffers",
        "buffers.append(model.candidate_block_buffer)",
        "pass",
        V41_TEST,
    ),
    "buffers always resolve to microbatch 0's (DSv41)": edit(
        "ubatch_buffers:resolve_buffer", None, "return buffer", V41_TEST
    ),
    "attention layers read vLLM's buffers (DSv41)": edit(
        "patches.deepseek_v41_attention:apply",
        'per_ubatch_buffers(target.DeepseekV4Attention, "topk_indices_buffer", '
        '"candidate_block_buffer")',
        "pass",
        V41_TEST,
    ),
    "indexer op writes vLLM's top-k buffer (DSv41)": edit(
        "patches.deepseek_v41_attention:apply",
        "indexer.attn_cls = per_ubatch_op(indexer.attn_cls)",
        "pass",
        V41_TEST,
    ),
    "indexer op reads vLLM's candidate blocks (DSv41)": edit(
        "patches.deepseek_v41_attention",
        'OP_BUFFERS = ("topk_indices_buffer", "candidate_blocks")',
        'OP_BUFFERS = ("topk_indices_buffer",)',
        V41_TEST,
    ),
    "index group always returns microbatch 0's state (FLASH_ATTN_MLA_SPARSE)": edit(
        "core:UbatchTopkField.__get__", "ubatch_id and group.ubatch_topk_states", "False", FA3_TEST
    ),
    "leader's writers not wired to the impl's buffer (FLASHMLA_SPARSE fp8)": edit(
        "patches.deepseek_v32_attention:apply",
        "target.DeepseekV32Attention.topk_indices_buffer = IMPL_TOPK_INDICES_BUFFER",
        "pass",
        FLASHMLA_FP8_TEST,
    ),
    "impl not wired to the per-microbatch logical buffers (FLASHINFER_MLA_SPARSE_SM90)": edit(
        "patches.sparse_mla_attention:topk_indices_buffer",
        'return resolve_logical_topk(getattr(self, "index_group", None), buffer)',
        "return buffer",
        SM90_TEST,
    ),
    "followers without an index group loaded under DBO (XPU_MLA_SPARSE)": edit(
        "diagnostics.refusals:check_wired",
        "[m for m in model.modules() if reads_topk_without_index_group(m)]",
        "[]",
        XPU_TEST,
    ),
    "only base_loader's alias of initialize_model checked (IPC loader)": edit(
        "diagnostics.load_check:",
        '_checking("initialize_model")',
        "lambda target: setattr(__import__(target.__name__.replace('utils', 'base_loader'), "
        "fromlist=['x']), 'initialize_model', checked_build(target.initialize_model))",
        f"{LOADER_TEST}[ipc_cache]",
    ),
    "vLLM-tensorized models built unchecked": edit(
        "diagnostics.load_check:",
        '_checking("init_tensorizer_model")',
        "lambda target: None",
        f"{LOADER_TEST}[tensorizer_vllm_tensorized]",
    ),
    "modules that imported a build function before registration keep vLLM's": edit(
        "patches._shared:replace_function",
        'getattr(holder, "__dict__", {}).get(name) is stock',
        "False",
        ALIAS_TEST,
    ),
    "other vLLM versions refuse nothing": edit(
        "guard:_at_config_creation.install.__post_init__",
        "refuse_unfixed(self, why)",
        "pass",
        GUARD_TEST,
    ),
    "a point release's changed seam patched blind": edit(
        "patches:_outcome",
        "patch.check(target) or (what if form is carried.Form.CHANGED else None)",
        "patch.check(target)",
        f"{LIVE}::test_point_release_patched_seam_by_seam",
    ),
    "another series taken for a supported release": edit(
        "settings:release_of",
        "Version(r).release[:2] == series",
        "True",
        GUARD_TEST,
    ),
    "the patches a vLLM carries applied over its own": edit(
        "patches:_outcome",
        "form is carried.Form.CARRIED",
        "False",
        TREE_TEST,
    ),
    "patches built on the core left unapplied over vLLM's own core": edit(
        "patches:_outcome",
        "not (r in CORE and CORE <= CARRIED.keys())",
        "True",
        LEFT_OUT_TEST,
    ),
    "vLLM's own builder left without the run's count (compiled DSA in a tree)": edit(
        "patches.mla:count_ubatches", None, "pass", LEFT_OUT_TEST
    ),
    "traced code looks the group state up by thread (a tree)": edit(
        "patches.mla:wire", "traced_as_ubatch0(group)", "pass", LEFT_OUT_TEST
    ),
    "ROCm DSA attention's own buffer left a plain attribute (a tree)": edit(
        "patches.rocm_dsa_attention:apply",
        "target.DeepseekV32MLAAttention.topk_indices_buffer = IMPL_TOPK_INDICES_BUFFER",
        "pass",
        LEFT_OUT_TEST,
    ),
    "the compiled op writes microbatch 0's rows of vLLM's own (a tree)": edit(
        "core:resolve_logical_topk",
        "group.ubatch_topk_rows(buffer) if buffer is group.logical_topk_indices else buffer",
        "buffer",
        LEFT_OUT_TEST,
    ),
    "a tree's private follower groups always refused": edit(
        "diagnostics.refusals:left_shared",
        "ubatch_count(group) < num_ubatches or not getattr("
        "group, 'leader_writes_follow_impl', False)",
        "True",
        LEFT_OUT_TEST,
    ),
    "the guard checks at config creation only": edit(
        "guard:install",
        "put(why)",
        "put(why)\nbreak",
        f"{GUARD}::test_other_version_refuses_at_model_build_a_config_made_before_register",
    ),
    "MiniMax-M3's use_index_cache not matched by the guard": edit(
        "guard:sharing_keys",
        "return [SHARING_KEYS[-1]]",
        "return []",
        f"{GUARD}::test_guard_refuses_minimax_m3_with_index_cache",
    ),
    "the off switch refuses nothing": edit(
        "__init__:_register",
        "mode == REFUSE",
        "False",
        f"{GUARD}::test_off_switch_keeps_the_refusals_and_stock_is_explicit[off-keeps-refusals]",
    ),
    "HiSparse under DBO loaded": edit(
        "diagnostics.load_check:checked_build.checked",
        "refuse_hisparse(vllm_config)",
        "pass",
        "tests/test_plugin.py::"
        "test_hisparse_under_dbo_is_refused_at_load_with_or_without_followers",
    ),
    "thread registry not checked": edit(
        "patches.index_group:check",
        "core.thread_registry_mismatch() or builder_mismatch(target.SparseMLAIndexGroupBuilder)",
        "builder_mismatch(target.SparseMLAIndexGroupBuilder)",
        f"{LIVE}::test_thread_registry_check[registry_rebound]",
    ),
    "index-group builder signature not checked": edit(
        "patches.index_group:builder_mismatch",
        "found[:len(names)] != names",
        "False",
        f"{LIVE}::test_builder_signature_check",
    ),
    "indexer op body's cell not checked": edit(
        "patches.sparse_attn_indexer:check",
        'kernel is not getattr(op_body, "__wrapped__", None)',
        "False",
        f"{LIVE}::test_op_body_check[other_cell]",
    ),
    "DeepSeek-V4.1 buffers without copies loaded under DBO (ROCm)": edit(
        "diagnostics.refusals:hands_topk_outside_index_groups",
        'reuses_topk(module) and not ubatch_copies(stored_buffer(module, "topk_indices_buffer"))',
        "False",
        "tests/test_cross_layer_refusal.py::"
        "test_cross_layer_topk_outside_index_groups_refused_under_dbo[deepseek_v41 index sharing]",
    ),
    "DeepSeek-V4.1 indexers without a candidate buffer counted as readers": edit(
        "patches.deepseek_v41_model:hand_offs",
        'candidate_source >= 0 and getattr(config, "candidate_topk_blocks", 0) > 0',
        "candidate_source >= 0",
        "tests/test_memory.py::test_memory_follows_the_architecture[v41-no-candidate-blocks]",
    ),
    "DeepSeek-V4.1 indexer ops' buffers not checked": edit(
        "patches.deepseek_v41_attention:check",
        "next(filter(None, (unset_attributes(op.__init__, *OP_BUFFERS) for op in ops)), None)",
        "None",
        f"{LIVE}::test_deepseek_v41_attention_check",
    ),
    "a torch.compile'd DeepSeek-V4.1 model patched anyway": edit(
        "patches.deepseek_v41_model:check",
        "issubclass(model, TorchCompileWithNoGuardsWrapper)",
        "False",
        f"{LIVE}::test_deepseek_v41_model_check",
    ),
    "patches applied without the patches they need": edit(
        "patches:_outcome",
        '[f"{r}, left unapplied" for r in patch.requires if known[r] is not None]',
        "[]",
        "tests/test_patch_rocm_dsa.py::"
        "test_rocm_patches_skipped_off_rocm_when_their_module_cannot_import",
    ),
    "groups built for fewer microbatches than the run not refused": edit(
        "diagnostics.refusals:left_shared",
        'getattr(group, "num_ubatches", 1) < num_ubatches',
        'not hasattr(group, "num_ubatches")',
        f"{LIVE}::test_groups_built_for_fewer_microbatches_than_the_run_are_refused",
    ),
    "demo: the checker's raise ends the stock phase with a traceback": edit(
        "demo:main", "isolation.MicrobatchIsolationError", "KeyError", DEMO_RAISE_TEST
    ),
    "register raises on an unknown VLLM_DSA_DBO_CHECK": edit(
        "__init__:_register",
        'logger.error("vllm-dsa-dbo: %s. The isolation checker stays off.", e)\ncheck = None',
        "raise",
        REGISTER_ENV_TEST,
    ),
    "status passes over an unknown VLLM_DSA_DBO_CHECK": edit(
        "cli:check_line",
        'errors.append(f"{e}; vLLM logs this and runs with the checker off")',
        "pass",
        STATUS_ENV_TEST,
    ),
    "the checker counts a read outside a forward as a hand-off": edit(
        "diagnostics.isolation:IsolationChecker.read",
        "if reader.step is None: return",
        "",
        "tests/test_isolation.py::test_a_read_outside_a_forward_is_not_a_hand_off",
    ),
    "memory imports torch before it reads the config": edit(
        "cli:memory",
        "source, model = load_config(args)",
        "import torch\nsource, model = load_config(args)",
        f"{BAD_CONFIG}[missing]",
    ),
    "memory leaves a string index_topk_freq to vLLM": edit(
        "diagnostics.layout:_check_dsa",
        '_whole(text, "index_topk_freq", 1, 1)',
        "pass",
        f'{BAD_CONFIG}["index_topk_freq": "4"]',
    ),
    "memory sizes any architecture with index_topk": edit(
        "diagnostics.layout:check_config",
        "model_class not in CODE_PATHS",
        "False",
        f"{MEMORY_BUILT_TEST}[not-dsa]",
    ),
    "memory counts valid counts HYV4 does not keep": edit(
        "cli:memory",
        "followed if model.path.kept == GROUPS else 0",
        "followed",
        MEMORY_HYV4_TEST,
    ),
    "memory sizes DeepSeek-V4.1 on ROCm, which the loader refuses under DBO": edit(
        "diagnostics.layout",
        'CodePath("vllm/models/deepseek_v41/amd", "deepseek_v41", REFUSED)',
        'CodePath("vllm/models/deepseek_v41/amd", "deepseek_v41", MODEL_WIDE)',
        MEMORY_V41_ROCM_TEST,
    ),
    "memory leaves out DeepSeek-V4.1's copies": edit(
        "cli:memory",
        "sum(tokens * columns * 4 for _, columns in model.buffers)",
        "0",
        MEMORY_V41_TEST,
    ),
    "ab compares runs on other questions": edit(
        "ab:compare", "check_same_questions(ref, run)", "pass", AB_QUESTIONS_TEST
    ),
    "ab merges two runs' samples files": edit(
        "ab:samples_file", "len(files) > 1", "False", AB_TWO_RUNS_TEST
    ),
    "upstream change builds the model with one microbatch": text(
        UPSTREAM_CHANGE,
        "\n            get_num_ubatches(vllm_config.parallel_config),\n",
        "\n",
        UPSTREAM_CODE_TEST,
    ),
    "upstream change adds a mypy error": text(
        UPSTREAM_CHANGE,
        "                self.impl.topk_indices_buffer,  # type: ignore[attr-defined]\n",
        "                self.impl.topk_indices_buffer,\n",
        UPSTREAM_HOOKS_TEST,
    ),
    "upstream change calls torch.cuda": text(
        UPSTREAM_CHANGE,
        "            group.set_logical_topk_ready(leader_index)\n",
        "            group.set_logical_topk_ready(leader_index)\n"
        "            torch.cuda.synchronize()\n",
        UPSTREAM_HOOKS_TEST,
    ),
    "upstream-patch patches a statement that differs from its release's": edit(
        "upstream:patched",
        'if differ: raise PatchRefused(path, differ[0], f"differs from vLLM {change.version}\'s")',
        "",
        UPSTREAM_REFUSAL_TEST,
    ),
    "upstream-patch patches another version": edit(
        "upstream:release",
        "version is not None and version not in RELEASES",
        "False",
        UPSTREAM_VERSION_TEST,
    ),
    "upstream-patch exits 0 on a tree it refuses": edit(
        "cli:upstream_patch",
        'raise UsageError(f"cannot patch {src}: {e}; nothing written") from None',
        "return 0",
        UPSTREAM_REFUSAL_TEST,
    ),
    "upstream-patch --dry-run writes": edit(
        "cli:upstream_patch", "args.dry_run", "False", UPSTREAM_DRY_RUN_TEST
    ),
    "Mistral Large 4's index_sharing not matched by the guard": edit(
        "guard:sharing_keys",
        'getattr(text_config, "index_sharing", None) is not None and '
        "index_sharing_shares(text_config)",
        "False",
        f"{GUARD}::test_guard_refuses_mistral_index_sharing",
    ),
    "the guard's own index_sharing rule takes only 'shared' for a follower": edit(
        "guard:index_sharing_shares",
        'any(kind != "full" for kind in text_config.index_sharing)',
        '"shared" in text_config.index_sharing',
        f"{GUARD}::test_guard_refuses_every_index_sharing_value_but_full[own-full,FULL,full,full]",
    ),
    "a reloaded plugin puts a second finder on sys.meta_path": edit(
        "patches._on_import",
        "next(filter(_is_ours, sys.meta_path), None) or _Finder()",
        "_Finder()",
        "tests/test_plugin.py::test_plugin_imported_twice_keeps_one_finder_and_model_imports_work",
    ),
    "the guard leaves vLLM-tensorized models unrefused": edit(
        "guard",
        '_at_model_build(f"{LOADERS}.tensorizer", "init_tensorizer_model")',
        '_at_model_build(f"{LOADERS}.tensorizer", "no_such_seam")',
        f"{GUARD}::test_refusals_hold_for_a_vllm_tensorized_model_of_a_config_made_before_register"
        "[off-switch]",
    ),
    "a tree's groups refused without DBO": edit(
        "diagnostics.refusals:left_shared",
        "if num_ubatches < 2 or not reads_another_layers_topk(group):\n    return False",
        "if not reads_another_layers_topk(group):\n    return False",
        "tests/test_upstream_tree_load.py::test_glm5_loads_in_a_patched_tree_with_and_without_dbo",
    ),
    "a getter another plugin put back over the fix's loaded under DBO": edit(
        "diagnostics.refusals:check_wired",
        "num_ubatches > 1 and (differs := unresolved(model)) is not None",
        "False",
        f"{LIVE}::test_getter_replaced_after_register_is_refused_at_load",
    ),
    "the load-time probe reads as no microbatch (refuses every fixed model)": edit(
        "diagnostics.refusals:as_ubatch.run",
        "registry[threading.get_ident()] = ubatch_id",
        "pass",
        f"{LIVE}::test_failed_check_leaves_its_path_unwired_and_the_model_refused",
    ),
    "an initialize_model put over ours after register() builds unchecked": edit(
        "diagnostics.load_check:_check_base_loader",
        "target.record_metadata_for_reloading = "
        "checked_build_end(target.record_metadata_for_reloading)",
        "pass",
        "tests/test_patch_base_loader.py::"
        "test_initialize_model_replaced_after_registration_still_checks",
    ),
    "the load probe reads only getters, not the plain buffer a leader's writers read": edit(
        "diagnostics.refusals:resolved_topk",
        "reads_own_buffer(type(module))",
        'isinstance(getattr(type(module), "topk_indices_buffer", None), property)',
        f"{LIVE}::test_leader_buffer_made_plain_after_register_is_refused_at_load",
    ),
    "a tree carrying the change in part refused without naming what it lacks": edit(
        "carried:lacked",
        "_lacked_in_a_mix(found())",
        "[]",
        f"{PARTIAL_TREE_TEST}[index_group]",
    ),
    "what the patches set goes unrecorded, so a wrapper over it unnamed": edit(
        "patches:_apply",
        "_INSTALLED.setdefault((owner, attribute), []).append(vars(owner).get(attribute))",
        "pass",
        WRAPPED_GETTER_TEST,
    ),
    "a wrapper over a patch named as a replacement": edit(
        "patches:_wraps", "return layer is not None", "return False", WRAPPED_GETTER_TEST
    ),
    "status --check loads no other plugin, so names none of their wrappers": edit(
        "cli:print_patches",
        "if not problems:\n    load_plugins(problems)",
        "pass",
        "tests/test_cli.py::test_status_check_names_another_plugins_wrapper_over_a_patch",
    ),
    "the load probe skips one-layer index groups (HYV4's, ROCm DSA's)": edit(
        "diagnostics.refusals:unresolved",
        "filter(hands_topk, groups)",
        "(g for g in groups if g.num_layers > 1)",
        "tests/test_patch_hy_v4.py::test_hy_v4_getter_replaced_after_register_is_refused_naming_it",
    ),
    "a refusal for a replaced getter names no getter": edit(
        "diagnostics.refusals:check_wired",
        '"; ".join(overridden())',
        '""',
        "tests/test_patch_hy_v4.py::test_hy_v4_getter_replaced_after_register_is_refused_naming_it",
    ),
    "a wrapper over the load-time check goes unnamed": edit(
        "patches:overridden",
        "any(current is value for value in ours)",
        "True",
        "tests/test_patch_base_loader.py::test_a_wrapper_over_the_load_check_is_named",
    ),
}

# Mistral Large 4 came in vLLM 0.34.0: its mutations apply where its patches have a seam.
MISTRAL = "tests/test_patch_mistral.py"
MISTRAL_TEST = f"{MISTRAL}::test_mistral_followers_read_their_own_leaders_topk[fused]"
MISTRAL_UNWIRED_TEST = f"{MISTRAL}::test_mistral_leader_with_an_unwired_writer_is_refused"
MISTRAL_ROCM_TEST = f"{MISTRAL}::test_mistral_paths_left_unfixed_are_refused_at_load[rocm]"
if patches.matters(mistral_attention.PATCH):
    MUTATIONS |= {
        "Mistral indexer and its op left as vLLM's": skip("mistral_indexer", MISTRAL_TEST),
        "Mistral leaders not wired": skip("mistral_attention", MISTRAL_TEST),
        "Mistral fused Q launch clears microbatch 0's top-k": edit(
            "patches.mistral_indexer:apply",
            "indexer.topk_indices_buffer = property(_get, _set)",
            "pass",
            MISTRAL_TEST,
        ),
        "Mistral indexer op writes microbatch 0's top-k": edit(
            "patches.mistral_indexer:apply",
            "target.SparseAttnIndexer = per_ubatch_indexer_op(target.SparseAttnIndexer)",
            "pass",
            MISTRAL_TEST,
        ),
        "Mistral writers not given their leader's group": edit(
            "patches.mistral_attention:wire", "writer.index_group = group", "pass", MISTRAL_TEST
        ),
        "Mistral groups never marked wired": edit(
            "patches.mistral_attention:wire",
            "group.leader_writes_follow_impl = True",
            "pass",
            MISTRAL_TEST,
        ),
        "Mistral group marked wired whatever its leader's writers": edit(
            "patches.mistral_attention:wire",
            'if not all(hasattr(writer, "index_group") for writer in writers):\n    return',
            "pass",
            MISTRAL_UNWIRED_TEST,
        ),
        "the guard takes only 'shared' for a follower where vLLM's layer specs say more": edit(
            "guard:index_sharing_shares",
            "any(spec.use_sparse and not spec.has_indexer for spec in specs(text_config))",
            '"shared" in text_config.index_sharing',
            f"{GUARD}::test_guard_refuses_every_index_sharing_value_but_full"
            "[vllm-full,Shared,Shared,full]",
        ),
        "a mix of the tree's change and the plugin's patches vouched for on a model's path": edit(
            "carried:unvouched",
            "_lacked_in_a_mix({n: has for n, has in found().items() if n in on_path})",
            "[]",
            "tests/test_upstream_tree_load.py::"
            "test_a_tree_with_only_mistral_large_4s_files_leaves_glm5_to_the_plugin",
        ),
        "Mistral on ROCm, its leaders unwired, loaded under DBO": edit(
            "diagnostics.refusals:shares_topk_across_ubatches",
            "return not (kept and group.leader_writes_follow_impl)",
            "return not kept",
            MISTRAL_ROCM_TEST,
        ),
    }

MUTATIONS |= {
    "the registry check reads a wrapper's code, not vLLM's under it": edit(
        "core:thread_registry_mismatch",
        "inspect.unwrap(ubatching.UBatchContext.__enter__)",
        "ubatching.UBatchContext.__enter__",
        f"{LIVE}::test_thread_registry_check_reads_through_a_wrapper_of_vllms_enter",
    ),
    "microbatch 1 converts into microbatch 0's rows": edit(
        "core:UbatchTopkState.physical_topk_indices", None, "return self.rows", CORE_TEST
    ),
    "microbatch 1 writes and reads microbatch 0's logical rows": edit(
        "core:UbatchLogicalTopk.ubatch_rows", None, "return self.buffer", CORE_TEST
    ),
    "microbatch 1 records and waits on microbatch 0's events": edit(
        "core:UbatchTopkState.like",
        None,
        "return cls(group.physical_topk_indices, torch.empty_like(group.valid_topk_counts), "
        "group.logical_topk_ready, group.physical_topk_ready)",
        CORE_TEST,
    ),
    "microbatch 1 shares microbatch 0's valid counts": edit(
        "core:UbatchTopkState.like",
        "valid_topk_counts=torch.empty_like(group.valid_topk_counts)",
        "valid_topk_counts=group.valid_topk_counts",
        CORE_TEST,
    ),
    "the checker skips a follower's read in its private group (HYV4)": edit(
        "diagnostics.isolation:_check_sparse_mla_attention.topk_indices_buffer",
        "index > 0 or not group.has_indexer",
        "index > 0",
        "tests/test_patch_hy_v4.py::test_hy_v4_checker_checks_followers_in_private_groups[stock]",
    ),
    "the checker never counts a step past the workspace": edit(
        "diagnostics.isolation:IsolationChecker.past_workspace",
        "self.past_workspace_steps += 1",
        "pass",
        PAST_WORKSPACE_TEST,
    ),
    "a line that reads the impl's buffer taken for the change (a text match)": edit(
        "carried:_hands_on",
        "_buffers_handed_on(classes.get(cls)) == {buffer}",
        "buffer in ast.unparse(classes[cls])",
        "tests/test_carried.py::test_a_dead_read_of_the_impls_buffer_carries_nothing",
    ),
    "status reads the installed wheel's version, not the vLLM that imports": edit(
        "cli:status",
        "is_supported_vllm(vllm.__version__)",
        'is_supported_vllm(distribution("vllm").version)',
        "tests/test_cli.py::test_status_reads_the_version_of_the_vllm_that_imports",
    ),
    "status takes a vLLM that does not import for one that does": edit(
        "cli:vllm_unusable",
        "import vllm",
        "pass",
        "tests/test_cli.py::test_status_on_a_vllm_that_does_not_import",
    ),
}


def copy_package(root: Path, *mutations: Mutation) -> Path:
    """The package copied under `root`, each of `mutations` applied to its module."""
    copy = root / "vllm_dsa_dbo"
    # With its bytecode: each file keeps its time and size, so only a mutated one is compiled.
    shutil.copytree(Path(vllm_dsa_dbo.__file__).parent, copy)
    for mutation in mutations:
        path = copy / mutation.path
        path.write_text(mutation.apply(path.read_text()))
    return root


def run_tests(package_root: Path, *tests: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *tests]
    return fresh.python(args, env, cwd=REPO)


# The tests the mutations fail, but the slow ones (trees): each runs in the suite, on the package.
SLOW = {UPSTREAM_HOOKS_TEST, TREE_TEST, LEFT_OUT_TEST}
FAST = sorted({mutation.test for mutation in MUTATIONS.values()} - SLOW)


def test_every_mutation_finds_its_site_once_in_a_reformatted_copy(tmp_path):
    """Reformatted (another line length and quote style), each module mutates as before."""
    package = Path(vllm_dsa_dbo.__file__).parent
    copy = copy_package(tmp_path) / "vllm_dsa_dbo"
    style = ["--line-length", "60", "--config", "format.quote-style='single'"]
    ruff = [sys.executable, "-m", "ruff", "format", "--isolated", "--no-cache", *style]
    subprocess.run([*ruff, str(copy)], check=True, capture_output=True)
    for name, mutation in MUTATIONS.items():
        source, reformatted = (
            (package / mutation.path).read_text(),
            (copy / mutation.path).read_text(),
        )
        assert reformatted != source, mutation.path
        assert mutation.apply(reformatted) == mutation.apply(source), name


def test_a_mutated_copy_differs_from_the_package_only_by_its_mutation():
    """Each module a mutation edits, unparsed as `Mutation.apply` writes it, parses back to
    the same syntax tree: the same code, but for its line numbers."""
    package = Path(vllm_dsa_dbo.__file__).parent
    for path in {mutation.path for mutation in MUTATIONS.values()}:
        tree = ast.parse((package / path).read_text())
        if ast.dump(ast.parse(ast.unparse(tree))) != ast.dump(tree):
            pytest.fail(f"{path} is another syntax tree once unparsed")  # not a diff of dumps


def test_mutated_tests_pass_on_an_unmutated_copy(tmp_path):
    """Run as the mutations run them (a copy first on the path, each in a fresh interpreter),
    the tests pass: a mutation's test fails by its mutation, not by the copy."""
    result = run_tests(copy_package(tmp_path), *FAST)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{len(FAST)} passed" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("name", MUTATIONS)
def test_core_test_fails_under_mutation(name, tmp_path):
    mutation = MUTATIONS[name]
    result = run_tests(copy_package(tmp_path, mutation), mutation.test)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "AssertionError" in result.stdout or "DID NOT RAISE" in result.stdout
    assert "1 failed" in result.stdout
