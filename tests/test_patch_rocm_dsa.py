"""ROCm DSA (GLM-5 / DeepSeek-V3.2 on ROCm): leaders hand the logical top-k to
followers in private index groups; one DBO step through vLLM's ROCm
DeepseekV32Model, its decoder layers, DeepseekV32MLAAttention (with its
DeepseekV32ROCmIndexer and SparseAttnIndexer op) and ROCMAiterMLASparseImpl.

Everything is built by vLLM's own __init__s. Faked, because only ROCm has it:
the indexer kernel `torch.ops.vllm.rocm_aiter_sparse_attn_indexer` (writes the
top-k this test gives it into the buffer it is handed) and `vllm.platforms.rocm`
(a gfx950 GPU, so forward_hip dispatches to that op); the impl's attention
kernel `_forward_mla` (records the converted indices it would read); the
dense-MHA prefill backend probe (none); the attention metadata, reduced to the
fields forward_mqa reads, one object per microbatch and attention group as
vLLM's per-microbatch metadata builders make them. The leader's
`fused_norm_rope` is not run: its top-k effect (clearing the rows of the
buffer `_fused_attention` hands it, `self.topk_indices_buffer`) is done on
that same attribute. The logical -> physical remap is vLLM's ROCm
`forward_mqa` with its Triton kernels, interpreted.

Layers 0 and 1 lead; 2 and 3 follow 1. Layer 2 shares the leaders' attention
metadata (its remap is skipped: it reads what layer 1 converted); layer 3 has
metadata of its own (a follower in another KV cache group: it converts from
the logical buffer itself).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from ubatch_rows import address, ubatch1_logical
from vllm_dsa_dbo.cpu_dbo import TOKENS_PER_UBATCH, Source, logical_topk, metadata

LEADERS = [True, True, False, False]
INDEX_TOPK = 128
BLOCK_SIZE = 64
MAX_NUM_BATCHED_TOKENS = 32
# Attention group (metadata object) of each layer.
METADATA_GROUP = [0, 0, 0, 1]


def hf_config():
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=16,
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=64,
        intermediate_size=64,
        moe_intermediate_size=64,
        n_routed_experts=1,
        first_k_dense_replace=4,
    )
    # index_topk_freq 3 with vLLM's default offset 2: layers 2 and 3 reuse 1's.
    config.index_topk, config.index_n_heads, config.index_head_dim = INDEX_TOPK, 2, 128
    config.index_topk_freq = 3
    return config


def build_rocm_dsa_model(monkeypatch, vllm_env, enable_dbo: bool):
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.models.deepseek_v32.amd import model as rocm_model
    from vllm.v1.worker import workspace

    def no_prefill_backend(*args, **kwargs):
        raise ValueError("no MLA prefill backend on this CPU")

    hf = hf_config()
    monkeypatch.setattr(vllm_env.parallel_config, "enable_dbo", enable_dbo)
    monkeypatch.setattr(vllm_env.compilation_config, "static_forward_context", {})
    monkeypatch.setattr(vllm_env.scheduler_config, "max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS)
    monkeypatch.setattr(vllm_env.attention_config, "sparse_mla_prefill_workspace_factor", 1)
    monkeypatch.setattr(
        vllm_env,
        "model_config",
        SimpleNamespace(max_model_len=64, dtype=torch.bfloat16, hf_config=hf, hf_text_config=hf),
    )
    monkeypatch.setattr(mla_attention, "get_mla_prefill_backend", no_prefill_backend)
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"), 2)
    from vllm.platforms import current_platform

    # This CPU build of vLLM detects no platform; the model allocates its
    # logical buffer on current_platform.device_type.
    monkeypatch.setattr(type(current_platform), "device_type", "cpu", raising=False)
    return rocm_model.DeepseekV32Model(vllm_config=vllm_env, prefix="model")


class ROCmDSAStep:
    """One DBO step: a leader runs its indexer as `_fused_attention` does, then
    every layer reads its top-k through the ROCm impl's `forward_mqa`."""

    def __init__(self, model, monkeypatch) -> None:
        from vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse import (
            ROCMAiterMLASparseImpl,
            ROCMAiterMLASparseMetadata,
        )

        self.attns = [layer.self_attn for layer in model.layers]
        self.inputs = {
            (u, i): logical_topk(Source(u, i))
            for u in (0, 1)
            for i, leads in enumerate(LEADERS)
            if leads
        }
        self.kv_cache = torch.zeros(64, BLOCK_SIZE, 576, dtype=torch.bfloat16)
        fields = ROCMAiterMLASparseMetadata.__dataclass_fields__
        self.defaults = {f: fields[f].default for f in ("remapped_buf", "remapped_epoch")}
        # One metadata object per microbatch and attention group.
        self.metadata = {(u, g): self.new_metadata(u) for u in (0, 1) for g in set(METADATA_GROUP)}
        self.op_buffers: list[torch.Tensor] = []
        self.read_indices: list[torch.Tensor] = []
        monkeypatch.setattr(
            torch.ops.vllm, "rocm_aiter_sparse_attn_indexer", self._indexer_kernel, raising=False
        )
        monkeypatch.setitem(
            sys.modules,
            "vllm.platforms.rocm",
            SimpleNamespace(on_gfx11=lambda: False, on_gfx950=lambda: True),
        )
        monkeypatch.setattr(
            ROCMAiterMLASparseImpl,
            "_forward_mla",
            lambda impl, *args: self._attention_kernel(impl, *args),
        )

    def new_metadata(self, ubatch: int) -> SimpleNamespace:
        """What a microbatch's ROCMAiterMLASparseMetadataBuilder hands the
        impl: its own paged_kv_indices buffer; every token keeps top-k slots."""
        meta = metadata(ubatch)
        n = TOKENS_PER_UBATCH[ubatch]
        return SimpleNamespace(
            req_id_per_token=meta.req_id_per_token,
            block_table=meta.block_table,
            block_size=BLOCK_SIZE,
            topk_tokens=INDEX_TOPK,
            paged_kv_indptr=torch.arange(n + 1, dtype=torch.int32) * INDEX_TOPK,
            paged_kv_indices=torch.zeros(MAX_NUM_BATCHED_TOKENS * INDEX_TOPK, dtype=torch.int32),
            **self.defaults,
        )

    def _indexer_kernel(
        self, hidden_states, prefix, kv_cache, q_fp8, k, weights, *args, **kwargs
    ) -> torch.Tensor:
        """torch.ops.vllm.rocm_aiter_sparse_attn_indexer: writes the pending
        top-k into the buffer the op was handed (its 13th argument)."""
        buffer = args[6]
        buffer[: self._pending.shape[0]] = self._pending
        self.op_buffers.append(buffer)
        return buffer

    def _attention_kernel(self, impl, layer, q, kv_cache, attn_metadata):
        """The aiter sparse MLA kernel: reads paged_kv_indices."""
        n = q.shape[0]
        self.read_indices.append(attn_metadata.paged_kv_indices[: n * INDEX_TOPK].clone())
        return q.new_zeros(n, q.shape[1], impl.kv_lora_rank), None

    def lead(self, layer: int, ubatch: int) -> None:
        attn, logical = self.attns[layer], self.inputs[ubatch, layer]
        n = logical.shape[0]
        attn.topk_indices_buffer[:n] = -1  # fused_norm_rope's clear (rocm.py:240)
        self._pending = logical
        hidden = torch.zeros(n, 32)
        attn._run_indexer(hidden, hidden, hidden)  # indexer_op.forward_hip

    def read(self, layer: int, ubatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        attn, n = self.attns[layer], TOKENS_PER_UBATCH[ubatch]
        logical = attn.impl.topk_indices_buffer[:n].clone()
        q = torch.zeros(n, 16, 576, dtype=torch.bfloat16)
        meta = self.metadata[ubatch, METADATA_GROUP[layer]]
        attn.impl.forward_mqa(q, self.kv_cache, meta, attn)
        return logical, self.read_indices.pop()

    def physical(self, source: Source) -> torch.Tensor:
        """What vLLM's ROCm remap makes of `source`'s top-k, alone."""
        from vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse import (
            triton_convert_req_index_to_global_index,
        )

        meta = self.new_metadata(source.ubatch)
        n = TOKENS_PER_UBATCH[source.ubatch]
        triton_convert_req_index_to_global_index(
            meta.req_id_per_token,
            meta.block_table,
            self.inputs[source.ubatch, source.leader],
            meta.paged_kv_indptr,
            meta.paged_kv_indices,
            BLOCK_STRIDE_ROWS=BLOCK_SIZE,
            BLOCK_SIZE=BLOCK_SIZE,
            NUM_TOPK_TOKENS=INDEX_TOPK,
        )
        return meta.paged_kv_indices[: n * INDEX_TOPK].clone()

    def run(self) -> list[tuple[int, int, Source, Source | None, Source | None]]:
        """(layer, microbatch, expected, logical read's source, physical read's source)."""
        from vllm.v1.worker.ubatching import dbo_yield

        from vllm_dsa_dbo.cpu_dbo import run_dbo_step

        raw = {}

        def step(ubatch: int) -> None:
            for layer, leads in enumerate(LEADERS):
                if leads:
                    self.lead(layer, ubatch)
                raw[layer, ubatch] = self.read(layer, ubatch)
                dbo_yield()

        run_dbo_step(step)
        written = {
            s: (self.inputs[s.ubatch, s.leader], self.physical(s))
            for s in (Source(u, i) for (u, i) in self.inputs)
        }

        def source(read: torch.Tensor, part: int) -> Source | None:
            return next((s for s, w in written.items() if torch.equal(read, w[part])), None)

        return [
            (
                layer,
                u,
                Source(u, max(i for i in range(layer + 1) if LEADERS[i])),
                source(logical, 0),
                source(physical, 1),
            )
            for (layer, u), (logical, physical) in sorted(raw.items())
        ]


def test_rocm_dsa_followers_read_their_own_leaders_topk(fake_gpu, monkeypatch):
    from vllm.models.deepseek_v32.amd.rocm import DeepseekV32MLAAttention
    from vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse import ROCMAiterMLASparseImpl

    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    model = build_rocm_dsa_model(monkeypatch, fake_gpu, enable_dbo=True)
    step = ROCmDSAStep(model, monkeypatch)
    assert all(type(a) is DeepseekV32MLAAttention for a in step.attns)
    assert all(type(a.impl) is ROCMAiterMLASparseImpl for a in step.attns)
    groups = [a.impl.index_group for a in step.attns]
    assert len({id(g) for g in groups}) == 4 and [g.has_indexer for g in groups] == LEADERS

    reads = step.run()

    wrong = [
        (layer, u, logical, physical)
        for layer, u, expected, logical, physical in reads
        if not logical == physical == expected
    ]
    assert wrong == []
    assert len(reads) == 8 and len(step.op_buffers) == 4
    # Microbatch 1's leaders wrote its own buffer, microbatch 0's vLLM's own.
    extra = groups[0].ubatch_logical_topk
    assert extra.followed and all(g.ubatch_logical_topk is extra for g in groups)
    ubatch1 = ubatch1_logical(extra)
    assert sorted(address(b) == ubatch1 for b in step.op_buffers) == [False, False, True, True]
    check_wired(model, 2)
    assert "2 microbatches, 2 index groups with followers, 0 bytes" in describe(model)


def test_rocm_dsa_without_dbo_allocates_nothing(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    model = build_rocm_dsa_model(monkeypatch, fake_gpu, enable_dbo=False)
    attns = [layer.self_attn for layer in model.layers]
    assert all(not a.impl.index_group.ubatch_logical_topk.followed for a in attns)
    assert all(a.indexer_op.index_group is None for a in attns if a.indexer_op is not None)
    check_wired(model)
    assert describe(model) is None


def test_rocm_dsa_unwired_followers_are_refused(fake_gpu, monkeypatch):
    """The ROCm DSA model as vLLM builds it, unwired: the loader refuses it under DBO."""
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.patches import rocm_dsa_model

    monkeypatch.setattr(rocm_dsa_model, "share_ubatch_logical_topk", lambda groups, leaders: None)
    model = build_rocm_dsa_model(monkeypatch, fake_gpu, enable_dbo=True)
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        check_wired(model, 2)


def test_rocm_patches_skipped_off_rocm_when_their_module_cannot_import(monkeypatch):
    """diagnose() skips a ROCm patch whose module fails to import off ROCm (and the
    patch that needs it), and on ROCm leaves both unapplied, saying why."""
    import importlib

    from vllm_dsa_dbo import patches

    real_import = importlib.import_module

    def import_module(name, *args):
        if name == "vllm.models.deepseek_v32.amd.rocm":
            raise ImportError("no aiter here")
        return real_import(name, *args)

    monkeypatch.setattr(patches.importlib, "import_module", import_module)
    monkeypatch.setattr(patches, "_on_rocm", lambda: False)
    wiring = patches.diagnose(patches.fix_patches())
    assert "rocm_dsa_attention" not in wiring and "rocm_dsa_model" not in wiring
    assert wiring["index_group"] is None
    monkeypatch.setattr(patches, "_on_rocm", lambda: True)
    model_target = real_import("vllm.models.deepseek_v32.amd.model")
    monkeypatch.setattr(model_target, patches._APPLIED, (), raising=False)  # as before register
    wiring = patches.diagnose(patches.fix_patches())
    assert "no aiter here" in wiring["rocm_dsa_attention"]
    assert wiring["rocm_dsa_model"] == "needs rocm_dsa_attention, left unapplied"
