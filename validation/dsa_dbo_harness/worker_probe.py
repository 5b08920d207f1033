"""What each worker reports back through `collective_rpc`."""

from __future__ import annotations

import sys


def snapshot(worker) -> dict:
    import vllm
    from vllm.v1.attention.backends.mla import index_group

    import dsa_dbo_harness
    from vllm_dsa_dbo import patches
    from vllm_dsa_dbo.diagnostics import isolation
    from vllm_dsa_dbo.diagnostics.refusals import followed_groups, index_groups
    from vllm_dsa_dbo.diagnostics.startup import ubatch_topk_bytes

    model = worker.model_runner.model
    groups = index_groups(model)
    # With the fix disabled the groups are vLLM's own, without microbatch state; the
    # isolation checker's own patch of the module is no sign of the fix.
    patched = "index_group" in patches.applied(index_group)
    checker = isolation.CHECKER
    return {
        "vllm_version": vllm.__version__,
        "runner": dsa_dbo_harness.runner_name(worker.model_runner),
        "plugin_patched": patched,
        "harness_gates": list(dsa_dbo_harness.GATES),
        "harness_variants": list(dsa_dbo_harness.VARIANTS),
        "attention_backends": sparse_mla_backends(model),
        "kv_cache_dtype": worker.cache_config.cache_dtype,
        "prefix_caching": worker.cache_config.enable_prefix_caching,
        "counts": dict(dsa_dbo_harness.COUNTS),
        "measured": dsa_dbo_harness.MEASURED,
        "switch_interval_s": sys.getswitchinterval(),
        "isolation_check": None
        if checker is None
        else {
            "mode": checker.mode,
            "checked_reads": checker.checked_reads,
            "past_workspace_steps": checker.past_workspace_steps,
            "violations": sum(checker.violations.values()),
            "violating_pairs": sorted(" -> ".join(k) for k in checker.violations),
        },
        "index_groups": len(groups),
        "traced_ubatch0_groups": sum(map(traced_as_ubatch0, groups)),
        "groups_with_followers": len(followed_groups(groups)) if patched else 0,
        "ubatch_topk_bytes": ubatch_topk_bytes(groups) if patched else 0,
        "model_memory_bytes": worker.model_runner.model_memory_usage,
        "num_gpu_blocks": worker.cache_config.num_gpu_blocks,
    }


def traced_as_ubatch0(group) -> bool:
    """Whether traced code reads the group's microbatch-0 state through the plugin's lookup (a
    vLLM tree carrying the upstream change, the compiled deepseek_v2 path)."""
    lookup = getattr(group, "_topk_state", None)
    return getattr(lookup, "__qualname__", "").startswith("traced_as_ubatch0.")


def sparse_mla_backends(model) -> dict[str, int]:
    """Layers per (attention backend, impl class) among the sparse MLA layers."""
    from vllm_dsa_dbo.diagnostics.refusals import sparse_mla_backend

    found: dict[str, int] = {}
    for module in model.modules():
        backend = getattr(module, "attn_backend", None)
        if backend is None or "SPARSE" not in backend.get_name() or not hasattr(module, "impl"):
            continue
        key = f"{sparse_mla_backend(module)}/{type(module.impl).__name__}"
        found[key] = found.get(key, 0) + 1
    return found
