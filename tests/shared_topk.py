"""A shared top-k model slice built from vLLM's real index-group classes.

Three sparse MLA layers: A leads a group of its own, B leads a group that C
follows (GLM-5.x layers 1, 2 and 3). One DBO step runs every layer in both
microbatches, with the MoE's yield between layers, so the schedule is
A0 B0 | A1 B1 | C0 | C1: leader 0, leader 1, then followers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from types import SimpleNamespace

from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.models.deepseek_v32.attention import DeepseekV32Attention
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)
from vllm.v1.worker.ubatching import dbo_yield

from fake_gpu import run_dbo_step

INDEX_TOPK = 128
BLOCK_SIZE = 64
MAX_NUM_BATCHED_TOKENS = 32
MAX_DECODE_ROWS = 8
# Different lengths and requests per microbatch, so a wrong read shows.
TOKENS_PER_UBATCH = (6, 4)
REQS_PER_UBATCH = (2, 3)


def make_impl(
    builder: SparseMLAIndexGroupBuilder, buffer: torch.Tensor, leads: bool
) -> SparseMLACommonImpl:
    """A real sparse MLA impl registered in `builder` like the model's layers."""
    return SparseMLACommonImpl(
        num_heads=1,
        head_size=576,
        scale=1.0,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        qk_head_dim=192,
        v_head_dim=128,
        kv_b_proj=None,
        # Leaders own an indexer; the impl then resolves the buffer through it.
        indexer=SimpleNamespace(topk_indices_buffer=buffer) if leads else None,
        topk_indices_buffer=buffer,
        index_group_builder=builder,
    )


def attention_module(impl: SparseMLACommonImpl, buffer: torch.Tensor) -> nn.Module:
    """The `DeepseekV32Attention` state the leader's writers read from.

    Only what `DeepseekV32Attention.__init__` does with the buffer once its
    impl exists: the model's writers take `self.topk_indices_buffer`.
    """
    attn = DeepseekV32Attention.__new__(DeepseekV32Attention)
    nn.Module.__init__(attn)
    attn.impl = impl
    attn.topk_indices_buffer = buffer
    return attn


def ubatch_inputs(ubatch_id: int, seed: int = 0):
    """Logical top-k and attention metadata that differ per microbatch."""
    g = torch.Generator().manual_seed(seed * 10 + ubatch_id)
    n, reqs = TOKENS_PER_UBATCH[ubatch_id], REQS_PER_UBATCH[ubatch_id]
    logical = torch.randint(0, 4 * BLOCK_SIZE, (n, INDEX_TOPK), generator=g)
    logical[torch.rand(n, INDEX_TOPK, generator=g) < 0.2] = -1
    meta = SimpleNamespace(
        req_id_per_token=torch.randint(0, reqs, (n,), generator=g).int(),
        block_table=torch.randperm(64, generator=g)[: reqs * 4].view(reqs, 4).int(),
        block_size=BLOCK_SIZE,
    )
    return logical.int(), meta


def expected_physical(logical: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_convert_req_index_to_global_index(
        meta.req_id_per_token,
        meta.block_table,
        logical,
        BLOCK_SIZE=BLOCK_SIZE,
        NUM_TOPK_TOKENS=INDEX_TOPK,
        return_valid_counts=True,
    )


def convert(impl: SparseMLACommonImpl, num_tokens: int, meta):
    """What a sparse MLA impl's forward does with its top-k, cloned at read."""
    logical = impl.topk_indices_buffer[:num_tokens]
    physical, counts = impl._convert_logical_to_physical_topk(
        logical, meta, block_stride_rows=None, return_valid_counts=True
    )
    return logical.clone(), physical.clone(), counts.clone()


class SharedTopkSlice:
    def __init__(self, num_ubatches: int | None = 2) -> None:
        self.buffer = torch.full(
            (MAX_NUM_BATCHED_TOKENS, INDEX_TOPK), -1, dtype=torch.int32
        )
        kwargs = {} if num_ubatches is None else {"num_ubatches": num_ubatches}
        self.builder = SparseMLAIndexGroupBuilder(
            self.buffer, MAX_DECODE_ROWS, **kwargs
        )
        self.impl_a = make_impl(self.builder, self.buffer, leads=True)
        self.impl_b = make_impl(self.builder, self.buffer, leads=True)
        self.impl_c = make_impl(self.builder, self.buffer, leads=False)
        self.attn_a = attention_module(self.impl_a, self.buffer)
        self.attn_b = attention_module(self.impl_b, self.buffer)

    def lead(self, attn: nn.Module, impl: SparseMLACommonImpl, ubatch_id: int, seed: int):
        """A leader layer: write the logical top-k as fused_norm_rope and
        sparse_attn_indexer do (into the module's buffer), then attend."""
        logical, meta = ubatch_inputs(ubatch_id, seed)
        attn.topk_indices_buffer[: logical.shape[0]] = logical
        impl.record_logical_topk_ready()
        return convert(impl, logical.shape[0], meta)

    def run_step(self, seed: int = 0) -> dict:
        """One DBO step; returns what each layer read, per microbatch."""
        seen: dict = {}

        def step(u: int) -> None:
            seen["A", u] = self.lead(self.attn_a, self.impl_a, u, seed)
            dbo_yield()
            seen["B", u] = self.lead(self.attn_b, self.impl_b, u, seed)
            seen["writer is reader", u] = (
                self.attn_b.topk_indices_buffer is self.impl_c.topk_indices_buffer
            )
            dbo_yield()
            _, meta = ubatch_inputs(u, seed)
            seen["C", u] = convert(self.impl_c, TOKENS_PER_UBATCH[u], meta)

        run_dbo_step(step)
        return seen
