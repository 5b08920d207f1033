"""HYV4 (CUDA path): leaders hand the logical top-k to followers in private
index groups; one DBO step through vLLM's HYV4Model, HYV4 Indexer and its op,
and sparse MLA impls.

HYV4Model is built by its own __init__ with decoder layers reduced to the
attention state HYV4MLAAttention.__init__ builds, minus the sparse-backend
probe and projections a CPU cannot build. Layers 0 and 1 lead, 2 follows.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, make_impl, step_inputs

LEADERS = [True, True, False]
# index_topk_freq 2 with vLLM's default offset 2: layer 2 reuses layer 1's top-k.
HF_CONFIG = dict(
    num_hidden_layers=3,
    index_topk=128,
    index_topk_freq=2,
    index_n_heads=2,
    index_head_dim=128,
    qk_rope_head_dim=64,
    layer_types=["sparse_attention"] * 3,
    vocab_size=64,
    hidden_size=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    routed_scaling_factor=1.0,
    n_routed_experts=1,
    moe_intermediate_size=64,
    n_shared_experts=0,
    norm_topk_prob=True,
)
MAX_NUM_BATCHED_TOKENS = 32


class DecoderLayer(nn.Module):
    """A HYV4DecoderLayer reduced to its attention's top-k state: vLLM's
    Indexer (with its SparseAttnIndexer op) for a leader, and vLLM's sparse MLA
    impl with no builder, as MLAAttention builds it for HYV4."""

    block_type = "dense"

    def __init__(
        self, *, config, vllm_config, cache_config, quant_config, prefix, topk_indices_buffer
    ) -> None:
        from vllm.config import CacheConfig
        from vllm.models.hy_v4.nvidia.attention import (
            HYV4MLAAttention,
            Indexer,
            compute_skip_topk_layers,
        )

        super().__init__()
        attn = HYV4MLAAttention.__new__(HYV4MLAAttention)
        nn.Module.__init__(attn)
        attn.is_sparse = True
        attn.skip_topk = int(prefix.split(".")[-1]) in compute_skip_topk_layers(config)
        attn.indexer = None
        if not attn.skip_topk:
            indexer_config = SimpleNamespace(
                model_config=SimpleNamespace(max_model_len=64),
                attention_config=SimpleNamespace(sparse_mla_prefill_workspace_factor=1),
            )
            attn.indexer = Indexer(
                indexer_config,
                config,
                config.hidden_size,
                32,
                None,
                CacheConfig(),
                topk_indices_buffer,
                f"{prefix}.self_attn.indexer",
            )
        attn.mla_attn = nn.Module()
        attn.mla_attn.impl = make_impl(None, topk_indices_buffer, not attn.skip_topk, attn.indexer)
        self.self_attn = attn


def build_hyv4_model(monkeypatch, vllm_env, enable_dbo: bool) -> nn.Module:
    from vllm.models.hy_v4.nvidia import model as hy_v4_model

    monkeypatch.setattr(vllm_env.parallel_config, "enable_dbo", enable_dbo)
    monkeypatch.setattr(vllm_env.compilation_config, "static_forward_context", {})
    monkeypatch.setattr(hy_v4_model, "HYV4DecoderLayer", DecoderLayer)
    monkeypatch.setattr(hy_v4_model, "current_platform", SimpleNamespace(device_type="cpu"))
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**HF_CONFIG)),
        cache_config=None,
        quant_config=None,
        parallel_config=vllm_env.parallel_config,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS),
    )
    return hy_v4_model.HYV4Model(vllm_config=vllm_config, prefix="model")


class HYV4Stack(SharedTopkStack):
    """The HYV4 layers; a leader writes through its indexer op, as
    HYV4MLAAttention._indexer_and_attn runs it."""

    def __init__(self, model: nn.Module, monkeypatch) -> None:
        self.model = model
        self.leaders = LEADERS
        self.device = "cpu"
        self.buffer = model.topk_indices_buffer
        self.attns = [layer.self_attn for layer in model.layers]
        self.impls = [attn.mla_attn.impl for attn in self.attns]
        self.inputs, self.metadata = step_inputs(LEADERS)
        self.op_buffers: list[torch.Tensor] = []
        monkeypatch.setattr(torch.ops.vllm, "sparse_attn_indexer", self._indexer_kernel)

    def _indexer_kernel(self, *args, **kwargs) -> torch.Tensor:
        """torch.ops.vllm.sparse_attn_indexer: writes the pending top-k into
        the buffer the op was handed."""
        buffer = args[13]
        buffer[: self._pending.shape[0]] = self._pending
        self.op_buffers.append(buffer)
        return buffer

    def lead(self, layer: int, logical: torch.Tensor) -> None:
        self._pending = logical
        hidden = torch.zeros(logical.shape[0], 64)
        self.attns[layer].indexer.indexer_op.forward_cuda(hidden, hidden, hidden, hidden)
        self.impls[layer].record_logical_topk_ready()


def test_hy_v4_followers_read_their_own_leaders_topk(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    model = build_hyv4_model(monkeypatch, fake_gpu, enable_dbo=True)
    stack = HYV4Stack(model, monkeypatch)
    groups = [impl.index_group for impl in stack.impls]
    assert len({id(g) for g in groups}) == 3 and [g.has_indexer for g in groups] == LEADERS

    reads = stack.run_step()

    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == []
    assert len(reads) == 6 and len(stack.op_buffers) == 4
    check_wired(model, 2)
    extra = groups[0].ubatch_logical_topk
    assert extra.followed and all(g.ubatch_logical_topk is extra for g in groups)
    assert "2 microbatches, 1 index groups with followers, 0 bytes" in describe(model)


@pytest.mark.parametrize("enable_dbo, bad", [(True, False), (False, True)], ids=["fix", "stock"])
def test_hy_v4_checker_checks_followers_in_private_groups(fake_gpu, monkeypatch, enable_dbo, bad):
    """The isolation checker sees a follower's read of the logical top-k in its own group:
    none wrong with the fix, the other microbatch's without it (a model built for one)."""
    from vllm.model_executor.layers.attention import sparse_mla_attention

    from vllm_dsa_dbo.diagnostics import isolation

    checker = isolation.IsolationChecker("audit")
    monkeypatch.setattr(isolation, "CHECKER", checker)
    mixin, impl_cls = (
        sparse_mla_attention.SharedTopkIndicesBuffer,
        sparse_mla_attention.SparseMLACommonImpl,
    )
    monkeypatch.setattr(mixin, "topk_indices_buffer", mixin.topk_indices_buffer)
    monkeypatch.setattr(impl_cls, "record_logical_topk_ready", impl_cls.record_logical_topk_ready)
    [checked] = [p for p in isolation.PATCHES if p.name == "isolation_sparse_mla_attention"]
    checked.apply(sparse_mla_attention)

    HYV4Stack(
        build_hyv4_model(monkeypatch, fake_gpu, enable_dbo=enable_dbo), monkeypatch
    ).run_step()

    assert checker.checked_reads > 0
    assert bool(checker.violations) == bad, checker.violations


def test_hy_v4_without_dbo_allocates_nothing(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    model = build_hyv4_model(monkeypatch, fake_gpu, enable_dbo=False)
    groups = [layer.self_attn.mla_attn.impl.index_group for layer in model.layers]
    assert all(not g.ubatch_logical_topk.followed for g in groups)
    assert all(
        layer.self_attn.indexer.indexer_op.index_group is None
        for layer in model.layers
        if layer.self_attn.indexer is not None
    )
    check_wired(model)
    assert describe(model) is None


def test_hy_v4_unwired_followers_are_refused(fake_gpu, monkeypatch):
    """Private follower groups without per-microbatch copies (as HYV4 on ROCm
    builds them): the loader refuses the model under DBO."""
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.patches import hy_v4_model

    monkeypatch.setattr(hy_v4_model, "share_ubatch_logical_topk", lambda groups, leaders: None)
    model = build_hyv4_model(monkeypatch, fake_gpu, enable_dbo=True)
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        check_wired(model, 2)


def vllms_getter(self):
    """vLLM's SharedTopkIndicesBuffer.topk_indices_buffer, as a second plugin may put it back."""
    if self._indexer is not None:
        return self._indexer.topk_indices_buffer
    return self._topk_indices_buffer


def test_hy_v4_getter_replaced_after_register_is_refused_naming_it(fake_gpu, monkeypatch):
    """A second plugin puts vLLM's getter back over the fix's after register(): HYV4's layers,
    each in a one-layer group, read microbatch 0's top-k in microbatch 1, and the load check
    refuses the model, naming the getter."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SharedTopkIndicesBuffer,
    )

    from vllm_dsa_dbo.diagnostics.refusals import check_wired

    model = build_hyv4_model(monkeypatch, fake_gpu, enable_dbo=True)
    ours = SharedTopkIndicesBuffer.topk_indices_buffer
    monkeypatch.setattr(
        SharedTopkIndicesBuffer, "topk_indices_buffer", property(vllms_getter, ours.fset)
    )
    reads = HYV4Stack(model, monkeypatch).run_step()
    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == [(0, 1), (1, 1), (2, 1)]
    getter = (
        "vllm.model_executor.layers.attention.sparse_mla_attention.SharedTopkIndicesBuffer"
        ".topk_indices_buffer"
    )
    with pytest.raises(ValueError, match="Drop --enable-dbo") as refused:
        check_wired(model, 2)
    assert f"other code replaces {getter} (by vllms_getter at {__file__}:" in str(refused.value)
    assert "but a microbatch-1 thread at load finds that in microbatch 1" in str(refused.value)
