"""Every sparse MLA impl vLLM 0.33.0 can pick for a DSA model, through one DBO step.

Each test builds one backend's real impl class for four layers that share one
index-group builder, as `DeepseekV32Model` does (A and B lead, C and D follow
B), and runs leader 0, leader 1, then the followers (A0 A1 B0 B1 C0 C1 D0 D1,
yielding after every layer as the MoE does) in vLLM's microbatch threads. Each
leader writes its top-k through its `DeepseekV32Attention` state and every
layer calls the impl's own `forward_mqa`. Faked: CUDA streams and events
(`cpu_dbo`), the attention kernels the impls call (they record the indices and
lengths they are handed), vLLM's `concat_mla_q` op, FlashInfer's SM90
`plan()` (its index offsets are set as it sets them for full-width rows), and
the attention metadata, reduced to the fields `forward_mqa` reads, one object
per microbatch as vLLM's per-microbatch metadata builders make them. The
top-k conversions are vLLM's Triton kernels, interpreted. A read is right
when its kernel got exactly what the same impl hands it for its own leader's
top-k alone. COVERAGE.md says which impl reads what, and where.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from vllm_dsa_dbo.cpu_dbo import (
    BLOCK_SIZE,
    INDEX_TOPK,
    MAX_DECODE_ROWS,
    MAX_NUM_BATCHED_TOKENS,
    TOKENS_PER_UBATCH,
    Source,
    attention_module,
    logical_topk,
    make_impl,
    metadata,
)

LEADERS = [True, True, False, False]
# Prefill tokens of a mixed batch's microbatch (the rest decode).
NUM_PREFILL_TOKENS = 2


@dataclass(frozen=True)
class Variant:
    """One backend, KV cache dtype, batch kind and head count."""

    backend: str
    kv_cache_dtype: str = "auto"
    decode: bool = True
    num_heads: int = 16

    def __str__(self) -> str:
        batch = "decode" if self.decode else "mixed"
        return f"{self.backend}-{self.kv_cache_dtype}-{batch}-{self.num_heads}h"

    @property
    def backend_cls(self) -> type:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return AttentionBackendEnum[self.backend].get_class()

    @property
    def impl_cls(self) -> type:
        return self.backend_cls.get_impl_cls()

    @property
    def module(self) -> ModuleType:
        """Where the impl looks its kernels up."""
        return importlib.import_module(self.impl_cls.__module__)


def both_batches(backend: str, kv_cache_dtype: str = "auto") -> list[Variant]:
    return [Variant(backend, kv_cache_dtype, decode) for decode in (True, False)]


# FlashMLA's fp8 path at 16 heads is its mixed-batch kernel; at 64 heads it
# splits decode and prefill, the decode half through the group conversion.
VARIANTS = [
    *both_batches("FLASH_ATTN_MLA_SPARSE"),
    *both_batches("FLASHMLA_SPARSE"),
    *both_batches("FLASHMLA_SPARSE", "fp8_ds_mla"),
    Variant("FLASHMLA_SPARSE", "fp8_ds_mla", num_heads=64),
    *both_batches("FLASHINFER_MLA_SPARSE_SM90"),
    *both_batches("FLASHINFER_MLA_SPARSE_SM90", "fp8"),
    *both_batches("FLASHINFER_MLA_SPARSE"),
    *both_batches("FLASHINFER_MLA_SPARSE", "fp8"),
    *both_batches("FLASH_ATTN_MLA_SPARSE_FA4"),
    *both_batches("FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla"),
]


class Kernels:
    """The impls' attention kernels, faked: each call records what it reads."""

    def __init__(self) -> None:
        self.reads: list[tuple[torch.Tensor, ...]] = []

    def record(self, *tensors: torch.Tensor | None) -> None:
        self.reads.append(tuple(t.clone() for t in tensors if t is not None))

    def flash_attn_varlen_func(self, **kw: Any) -> Any:
        """FA3's qv kernel (block_table) or FA4's gather kernel."""
        if "block_table" in kw:
            self.record(kw["block_table"], kw["seqused_k"])
        else:
            self.record(kw["gather_kv_indices"], kw["gather_kv_valid_length"])
        q_v = kw["q_v"]
        return q_v.new_zeros(q_v.shape[0], q_v.shape[1], 512)

    def flash_mla_sparse_fwd(self, q, kv, indices, scale, topk_length=None, out=None):
        self.record(indices, topk_length)
        lse = torch.zeros(q.shape[0], q.shape[1])
        return q.new_zeros(q.shape[0], q.shape[1], 512), None, lse

    def flash_mla_with_kvcache(self, q, **kw: Any):
        self.record(kw["indices"])
        b, s, h, _ = q.shape
        return q.new_zeros(b, s, h, 512), torch.zeros(b, h, s)

    def trtllm_decode(self, *, query, block_tables, seq_lens, out=None, **kw: Any):
        """FlashInfer's trtllm-gen sparse MLA decode (SM100, SM120, FA4 prefill)."""
        self.record(block_tables, seq_lens)
        return query.new_zeros(query.shape[0], 1, query.shape[2], 512) if out is None else out

    def xpu_sparse(self, q, kv, indices, sm_scale):
        self.record(indices)
        return q.new_zeros(q.shape[0], q.shape[1], 512), None, None

    def sm90_run(self, state: Any, num_tokens: int) -> Callable[..., torch.Tensor]:
        """BatchMLAPagedAttentionWrapper.run of one builder's state: it reads the
        packed indices that state's plan() points it at."""

        def run(q_nope: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
            self.record(state.kv_indices[: num_tokens * INDEX_TOPK])
            return q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], 512)

        return run


def fake_flash_attn(monkeypatch) -> None:
    """vLLM's FA extension is CUDA-only; flashattn_mla_sparse imports its kernel."""
    package = ModuleType("vllm.vllm_flash_attn")
    interface = ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    interface.flash_attn_varlen_func = None
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(sys.modules, interface.__name__, interface)


def concat_mla_q(nope: torch.Tensor, pe: torch.Tensor, out: torch.Tensor) -> None:
    """vLLM's op: the query halves side by side, into the first heads of `out`."""
    out[:, : nope.shape[1]].copy_(torch.cat((nope, pe), -1))


def install_kernels(variant: Variant, monkeypatch) -> Kernels:
    from vllm import _custom_ops
    from vllm.utils import flashinfer as vllm_flashinfer

    kernels = Kernels()
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(1 << 20))
    if variant.backend.startswith("FLASH_ATTN"):
        fake_flash_attn(monkeypatch)
        monkeypatch.setattr(
            variant.module, "flash_attn_varlen_func", kernels.flash_attn_varlen_func
        )
    if variant.backend in ("FLASHINFER_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE_FA4"):
        import flashinfer.decode  # seconds to import: only where it runs

        monkeypatch.setattr(
            flashinfer.decode, "trtllm_batch_decode_with_kv_cache_mla", kernels.trtllm_decode
        )
    if variant.backend == "FLASHINFER_MLA_SPARSE_SM120":
        monkeypatch.setattr(
            vllm_flashinfer,
            "flashinfer_trtllm_batch_decode_with_kv_cache_mla",
            kernels.trtllm_decode,
        )
    if variant.backend == "FLASHMLA_SPARSE":
        monkeypatch.setattr(variant.module, "flash_mla_sparse_fwd", kernels.flash_mla_sparse_fwd)
        monkeypatch.setattr(
            variant.module, "flash_mla_with_kvcache", kernels.flash_mla_with_kvcache
        )
        monkeypatch.setattr(_custom_ops, "concat_mla_q", concat_mla_q)
    if variant.backend == "XPU_MLA_SPARSE":
        monkeypatch.setattr(variant.module, "triton_bf16_mla_sparse_interface", kernels.xpu_sparse)
    return kernels


@pytest.fixture
def sparse_env(fake_gpu, monkeypatch):
    """A CPU vLLM config sized like the demo's, with its workspaces."""
    from vllm.v1.worker import workspace

    monkeypatch.setattr(fake_gpu.scheduler_config, "max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS)
    monkeypatch.setattr(fake_gpu.attention_config, "sparse_mla_prefill_workspace_factor", 1)
    monkeypatch.setattr(
        fake_gpu,
        "model_config",
        SimpleNamespace(max_model_len=64, hf_text_config=SimpleNamespace(model_type="glm_moe_dsa")),
    )
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"), 2)
    # vLLM 0.34.0's FlashMLASparseImpl asks the device for its multiprocessor count.
    from vllm.v1.attention.backends.mla import flashmla_sparse

    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(flashmla_sparse, "num_compute_units", lambda *a: 132, raising=False)
    return fake_gpu


class BackendStack:
    """Four sparse MLA layers of one backend sharing an index-group builder."""

    def __init__(
        self,
        variant: Variant,
        monkeypatch,
        num_ubatches: int = 2,
        leaders: list[bool] = LEADERS,
        topk_start: int = 0,
    ) -> None:
        from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

        self.variant, self.leaders, self.topk_start = variant, leaders, topk_start
        self.kernels = install_kernels(variant, monkeypatch)
        self.buffer = torch.full((MAX_NUM_BATCHED_TOKENS, INDEX_TOPK), -1, dtype=torch.int32)
        self.builder = SparseMLAIndexGroupBuilder(
            self.buffer, MAX_DECODE_ROWS, num_ubatches=num_ubatches
        )
        self.impls = [self.new_impl(self.builder, self.buffer, leads) for leads in leaders]
        self.attns = [self.module_of(impl, leads) for impl, leads in zip(self.impls, leaders)]
        self.metadata = [self.new_metadata(u) for u in (0, 1)]
        self.kv_cache = self.new_kv_cache()
        self.inputs = {
            (u, i): logical_topk(Source(u, i))
            for u in (0, 1)
            for i, leads in enumerate(leaders)
            if leads
        }

    def new_impl(self, builder: Any, buffer: torch.Tensor, leads: bool) -> Any:
        """The backend's impl as MLAAttention builds it (leaders own an indexer)."""
        v = self.variant
        return make_impl(
            builder,
            buffer,
            leads,
            impl_cls=v.impl_cls,
            num_heads=v.num_heads,
            kv_cache_dtype=v.kv_cache_dtype,
            qk_nope_head_dim=192,
            v_head_dim=256,
        )

    def module_of(self, impl: Any, leads: bool) -> nn.Module:
        """The layer's MLAAttention state: its impl, backend and indexer (a
        leader's also the `DeepseekV32Attention` state its writers use)."""
        if leads:
            module = attention_module(impl, self.buffer)
        else:
            module = nn.Module()
            module.impl = impl
        module.attn_backend = self.variant.backend_cls
        module.indexer = SimpleNamespace() if leads else None
        return module

    def new_kv_cache(self) -> torch.Tensor:
        width = {"auto": 576, "fp8": 576, "fp8_ds_mla": 656}[self.variant.kv_cache_dtype]
        dtype = torch.bfloat16 if self.variant.kv_cache_dtype == "auto" else torch.uint8
        return torch.zeros(64, BLOCK_SIZE, width, dtype=dtype)

    def new_metadata(self, ubatch: int) -> SimpleNamespace:
        """What one microbatch's metadata builder hands the impls."""
        from vllm.v1.attention.backends.mla import flashmla_sparse

        v, n = self.variant, TOKENS_PER_UBATCH[ubatch]
        num_decode_tokens = n if v.decode else n - NUM_PREFILL_TOKENS
        meta = metadata(ubatch)
        meta.topk_start = self.topk_start
        meta.num_decode_tokens, meta.num_actual_tokens = num_decode_tokens, n
        meta.topk_tokens = INDEX_TOPK
        FP8 = flashmla_sparse.FlashMLASparseMetadata
        kernel_meta = FP8.FP8KernelMetadata(
            scheduler_metadata=None,
            dummy_block_table=torch.zeros(n, 1, dtype=torch.int32),
            cache_lens=torch.full((n,), 64, dtype=torch.int32),
        )
        meta.fp8_use_mixed_batch = v.num_heads < flashmla_sparse.MIN_HEADS_FOR_BF16_PREFILL
        if meta.fp8_use_mixed_batch:
            meta.fp8_extra_metadata = kernel_meta
        else:
            meta.fp8_extra_metadata = FP8.FP8SeparatePrefillDecode(
                num_decodes=n,
                num_decode_tokens=n,
                decode=FP8.FP8SeparatePrefillDecode.Decode(
                    seq_lens=kernel_meta.cache_lens, kernel_metadata=kernel_meta, decode_query_len=1
                ),
            )
        if v.backend == "FLASHINFER_MLA_SPARSE_SM90":
            meta.state = self.sm90_state(n)
        return meta

    def sm90_state(self, num_tokens: int) -> Any:
        """The builder-owned state; plan() for full-width rows sets these offsets."""
        from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import _SM90State

        state = _SM90State(
            torch.device("cpu"),
            self.variant.num_heads,
            torch.bfloat16,
            MAX_NUM_BATCHED_TOKENS,
            INDEX_TOPK,
            512,
            64,
            1.0,
            INDEX_TOPK,
            1,
        )
        torch.arange(MAX_NUM_BATCHED_TOKENS + 1, out=state.kv_indptr).mul_(INDEX_TOPK)
        state.wrapper.run = self.kernels.sm90_run(state, num_tokens)
        return state

    def forward(self, impl: Any, ubatch: int, meta: SimpleNamespace) -> tuple:
        """`impl.forward_mqa` on microbatch `ubatch`'s query; what its kernel read."""
        n, h = TOKENS_PER_UBATCH[ubatch], self.variant.num_heads
        q = tuple(torch.zeros(n, h, width, dtype=torch.bfloat16) for width in (512, 64))
        layer = SimpleNamespace(_k_scale_float=1.0, _q_scale_float=1.0)
        impl.forward_mqa(q, self.kv_cache, meta, layer)
        return self.kernels.reads.pop()

    def lead(self, layer: int, ubatch: int) -> None:
        """A leader's writes through its attention module, then its ready event."""
        logical = self.inputs[ubatch, layer]
        rows = slice(self.topk_start, self.topk_start + logical.shape[0])
        self.attns[layer].topk_indices_buffer[rows] = logical
        # XPUMLASparseImpl has none, and vLLM's DSA layers call it unconditionally.
        if hasattr(self.impls[layer], "record_logical_topk_ready"):
            self.impls[layer].record_logical_topk_ready()

    def alone(self, source: Source) -> tuple:
        """What the impl's kernel reads for `source`'s top-k in a layer of its own."""
        from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

        buffer = torch.full_like(self.buffer, -1)
        impl = self.new_impl(SparseMLAIndexGroupBuilder(buffer, MAX_DECODE_ROWS), buffer, True)
        logical = self.inputs[source.ubatch, source.leader]
        buffer[self.topk_start : self.topk_start + logical.shape[0]] = logical
        return self.forward(impl, source.ubatch, self.new_metadata(source.ubatch))

    def leader_of(self, layer: int) -> int:
        return max(i for i in range(layer + 1) if self.leaders[i])

    def run_step(self) -> list[tuple[int, int]]:
        """One DBO step; the (layer, microbatch) reads that got another top-k."""
        from vllm.v1.worker.ubatching import dbo_yield

        from vllm_dsa_dbo.cpu_dbo import run_dbo_step

        raw = {}

        def step(ubatch: int) -> None:
            for layer, leads in enumerate(self.leaders):
                if leads:
                    self.lead(layer, ubatch)
                raw[layer, ubatch] = self.forward(self.impls[layer], ubatch, self.metadata[ubatch])
                dbo_yield()

        run_dbo_step(step)
        expected = {Source(u, i): self.alone(Source(u, i)) for u, i in self.inputs}
        return [
            (layer, u)
            for (layer, u), read in sorted(raw.items())
            if not _same(read, expected[Source(u, self.leader_of(layer))])
        ]


def _same(read: tuple, written: tuple) -> bool:
    return len(read) == len(written) and all(map(torch.equal, read, written))


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_followers_read_their_own_leaders_topk(sparse_env, monkeypatch, variant):
    stack = BackendStack(variant, monkeypatch)
    assert stack.impls[2].index_group is stack.impls[1].index_group
    assert stack.run_step() == []


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_one_microbatch_of_state_shows_the_bug(sparse_env, monkeypatch, variant):
    """Stock vLLM's single copy: microbatch 1's leader overwrites what microbatch
    0's followers read, in this impl's own read path."""
    assert BackendStack(variant, monkeypatch, num_ubatches=1).run_step() == [(2, 0), (3, 0)]


@pytest.mark.parametrize("variant", both_batches("FLASHMLA_SPARSE"), ids=str)
def test_shardq_step_followers_read_their_own_leaders_topk(sparse_env, monkeypatch, variant):
    """A ShardQ step (vLLM 0.34.0, TP > 1): the leader writes the rank's tokens from row
    `topk_start` on and every impl reads from there, converting per layer."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl

    if "topk_start" not in SparseMLACommonImpl.forward_mqa.__code__.co_names:
        pytest.skip("this vLLM has no ShardQ (vLLM 0.34.0 added it)")
    assert BackendStack(variant, monkeypatch, topk_start=3).run_step() == []
    stock = BackendStack(variant, monkeypatch, num_ubatches=1, topk_start=3)
    assert stock.run_step() == [(2, 0), (3, 0)]


def test_xpu_followers_share_one_buffer_and_are_refused(sparse_env, monkeypatch):
    """XPU_MLA_SPARSE registers with no index group (vLLM's XPU path for GLM-5,
    and `--attention-backend XPU_MLA_SPARSE` passes the selector on CUDA too):
    nothing resolves its buffer per microbatch, so the loader refuses it."""
    variant = Variant("XPU_MLA_SPARSE")
    stack = BackendStack(variant, monkeypatch)
    assert [getattr(impl, "index_group", None) for impl in stack.impls] == [None] * 4
    assert stack.run_step() == [(2, 0), (3, 0)]

    model = nn.ModuleList(stack.attns)
    refusal = load_refusal(model, num_ubatches=2)
    assert "backend XPU_MLA_SPARSE keeps no index groups" in refusal
    assert "Drop --enable-dbo" in refusal
    assert load_refusal(model, num_ubatches=1) == ""
    every_layer_leads = BackendStack(variant, monkeypatch, leaders=[True] * 4)
    assert load_refusal(nn.ModuleList(every_layer_leads.attns), num_ubatches=2) == ""


def load_refusal(model: nn.Module, num_ubatches: int) -> str:
    """The loader's refusal of `model`, or "" when it loads."""
    from vllm_dsa_dbo.diagnostics.refusals import check_wired

    try:
        check_wired(model, num_ubatches)
    except ValueError as refused:
        return str(refused)
    return ""


def test_startup_line_names_the_sparse_mla_backend(sparse_env, monkeypatch):
    from vllm_dsa_dbo.diagnostics.startup import describe

    stack = BackendStack(Variant("FLASH_ATTN_MLA_SPARSE"), monkeypatch)
    line = describe(nn.ModuleList(stack.attns))
    assert line.endswith("allocated; sparse MLA backend FLASH_ATTN_MLA_SPARSE")
