"""What each worker reports back through `collective_rpc`."""

from __future__ import annotations


def snapshot(worker) -> dict:
    import dsa_dbo_harness
    from vllm.v1.attention.backends.mla import index_group

    groups, logical_lists = {}, {}
    for module in worker.model_runner.model.modules():
        group = getattr(getattr(module, "impl", None), "index_group", None)
        if group is not None:
            groups[id(group)] = group
            extra = getattr(group, "ubatch_logical_topk_indices", ())
            logical_lists[id(extra)] = extra
    tensors = [t for extra in logical_lists.values() for t in extra]
    for group in groups.values():
        for state in getattr(group, "ubatch_topk_states", ()):
            tensors += [state.physical_topk_indices, state.valid_topk_counts]
    return {
        "plugin_patched": getattr(index_group, "_vllm_dsa_dbo_patched", False),
        "counts": dict(dsa_dbo_harness.COUNTS),
        "index_groups": len(groups),
        "groups_with_followers": sum(
            1 for g in groups.values() if getattr(g, "ubatch_topk_states", ())
        ),
        "ubatch_topk_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "model_memory_bytes": worker.model_runner.model_memory_usage,
        "num_gpu_blocks": worker.cache_config.num_gpu_blocks,
    }
