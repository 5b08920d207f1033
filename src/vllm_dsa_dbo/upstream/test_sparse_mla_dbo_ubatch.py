# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared top-k index groups keep their state per DBO microbatch.

Layers 0 and 1 run the indexer and layer 2 reuses layer 1's top-k (GLM-5.x
layers 1-3): one index group without followers, one with a follower. Under
dual batch overlap both microbatches run their leaders before either runs the
follower; each follower must still read its own microbatch's top-k.
"""

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.forward_context import create_forward_context
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.models.deepseek_v32.attention import DeepseekV32Attention
from vllm.utils import torch_utils
from vllm.v1.attention.backends.mla.index_group import (
    HiSparseMLAIndexGroup,
    SparseMLAIndexGroupBuilder,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)
from vllm.v1.worker.ubatching import dbo_yield, make_ubatch_contexts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LEADERS = (True, True, False)
INDEX_TOPK = 128
BLOCK_SIZE = 64
MAX_NUM_TOKENS = 32
MAX_DECODE_ROWS = 8
# Different sizes per microbatch, so a read of the other one shows.
NUM_TOKENS = (6, 4)
NUM_REQS = (2, 3)


class _HostEvent:
    """CPU stand-in: one thread runs at a time on one stream, so nothing to order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


class _HostStream(_HostEvent):
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _set_stream(stream) -> None:
    torch_utils._current_stream_tls.value = stream


@pytest.fixture
def dbo_env(monkeypatch, tmp_path):
    """A vLLM config, a one-rank world and a compute stream; CPU stand-ins off CUDA."""
    if DEVICE == "cpu":
        monkeypatch.setattr(torch, "Event", _HostEvent)
        monkeypatch.setattr(torch, "Stream", _HostStream)
        monkeypatch.setattr(torch.cuda, "set_stream", _set_stream)
        stream = _HostStream()
    else:
        stream = torch.cuda.Stream()
    config = VllmConfig(device_config=DeviceConfig(device=DEVICE))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tmp_path / 'store'}",
            local_rank=0,
            backend="nccl" if DEVICE == "cuda" else "gloo",
        )
        initialize_model_parallel(1, 1)
        yield config, stream
    cleanup_dist_env_and_memory()
    torch_utils._current_stream_tls.value = None


def _impl(builder, buffer, leads: bool) -> SparseMLACommonImpl:
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
        indexer=SimpleNamespace(topk_indices_buffer=buffer) if leads else None,
        topk_indices_buffer=buffer,
        index_group_builder=builder,
    )


def _leader_attention(impl: SparseMLACommonImpl, buffer) -> DeepseekV32Attention:
    """What DeepseekV32Attention.__init__ sets up once its impl exists."""
    attn = DeepseekV32Attention.__new__(DeepseekV32Attention)
    nn.Module.__init__(attn)
    attn.impl = impl
    attn.topk_indices_buffer = buffer
    return attn


def _metadata(ubatch: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(1000 + ubatch)
    n, reqs = NUM_TOKENS[ubatch], NUM_REQS[ubatch]
    block_table = torch.randperm(64, generator=g)[: reqs * 4].view(reqs, 4)
    return SimpleNamespace(
        req_id_per_token=torch.randint(0, reqs, (n,), generator=g).int().to(DEVICE),
        block_table=block_table.int().to(DEVICE),
        block_size=BLOCK_SIZE,
    )


def _logical_topk(ubatch: int, layer: int) -> torch.Tensor:
    """A top-k unique to one leader in one microbatch (-1 marks unused slots)."""
    g = torch.Generator().manual_seed(100 * ubatch + layer)
    n = NUM_TOKENS[ubatch]
    topk = torch.randint(0, 4 * BLOCK_SIZE, (n, INDEX_TOPK), generator=g)
    topk[torch.rand(n, INDEX_TOPK, generator=g) < 0.2] = -1
    return topk.int().to(DEVICE)


def _run_dbo(step, stream, num_ubatches: int = 2) -> None:
    """`step(ubatch_id)` in vLLM's microbatch threads, handing over at dbo_yield()."""
    barrier = threading.Barrier(num_ubatches + 1)
    config = VllmConfig(device_config=DeviceConfig(device=DEVICE))
    contexts = make_ubatch_contexts(
        num_ubatches,
        compute_stream=stream,
        comm_stream=stream,
        forward_contexts=[create_forward_context(None, config) for _ in range(num_ubatches)],
        ready_barrier=barrier,
    )
    errors: list[BaseException] = []

    def main(context) -> None:
        torch.cuda.set_stream(stream)
        try:
            with context:
                step(context.id)
        except BaseException as e:
            errors.append(e)
            raise

    threads = [threading.Thread(target=main, args=(c,), daemon=True) for c in contexts]
    for t in threads:
        t.start()
    barrier.wait()
    contexts[0].cpu_wait_event.set()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a microbatch thread hung"


def test_dbo_ubatch_followers_read_their_own_leaders_topk(dbo_env):
    _, stream = dbo_env
    buffer = torch.full((MAX_NUM_TOKENS, INDEX_TOPK), -1, dtype=torch.int32, device=DEVICE)
    builder = SparseMLAIndexGroupBuilder(buffer, MAX_DECODE_ROWS, num_ubatches=2)
    impls = [_impl(builder, buffer, leads) for leads in LEADERS]
    attns = {i: _leader_attention(impls[i], buffer) for i, leads in enumerate(LEADERS) if leads}
    group_a, group_b, group_c = (impl.index_group for impl in impls)
    assert group_c is group_b and group_a is not group_b
    assert len(group_a.ubatch_topk_states) == 0
    assert len(group_b.ubatch_topk_states) == 1
    assert len(builder.ubatch_logical_topk.buffers) == 1

    metadata = [_metadata(u) for u in range(2)]
    written = {(u, i): _logical_topk(u, i) for u in range(2) for i in attns}
    seen_buffers: dict[tuple[int, int], torch.Tensor] = {}
    reads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def step(ubatch: int) -> None:
        # Leaders of both microbatches first, then the followers: DBO's order.
        for layer, impl in enumerate(impls):
            n = NUM_TOKENS[ubatch]
            if layer in attns:
                seen_buffers[ubatch, -1 - layer] = attns[layer].topk_indices_buffer
                attns[layer].topk_indices_buffer[:n] = written[ubatch, layer]
                impl.record_logical_topk_ready()
            seen_buffers[ubatch, layer] = impl.topk_indices_buffer
            logical = impl.topk_indices_buffer[:n]
            physical, counts = impl._convert_logical_to_physical_topk(
                logical,
                metadata[ubatch],
                block_stride_rows=None,
                return_valid_counts=True,
            )
            reads[ubatch, layer] = (logical.clone(), physical.clone(), counts.clone())
            if layer == 1:
                dbo_yield()

    _run_dbo(step, stream)
    if DEVICE == "cuda":
        torch.cuda.synchronize()

    for ubatch in range(2):
        # The follower's impl and its leader's writers resolve one buffer.
        expected_buffer = buffer if ubatch == 0 else builder.ubatch_logical_topk.buffers[0]
        for key in [(ubatch, 1), (ubatch, 2), (ubatch, -2)]:
            assert seen_buffers[key] is expected_buffer, key
        for layer in range(3):
            leader = layer if LEADERS[layer] else layer - 1
            logical = written[ubatch, leader]
            meta = metadata[ubatch]
            physical, counts = triton_convert_req_index_to_global_index(
                meta.req_id_per_token,
                meta.block_table,
                logical,
                BLOCK_SIZE=BLOCK_SIZE,
                NUM_TOPK_TOKENS=INDEX_TOPK,
                return_valid_counts=True,
            )
            got = reads[ubatch, layer]
            assert torch.equal(got[0], logical), (ubatch, layer)
            assert torch.equal(got[1], physical), (ubatch, layer)
            assert torch.equal(got[2], counts), (ubatch, layer)


def test_dbo_ubatch_one_microbatch_allocates_nothing(dbo_env):
    buffer = torch.full((MAX_NUM_TOKENS, INDEX_TOPK), -1, dtype=torch.int32, device=DEVICE)
    builder = SparseMLAIndexGroupBuilder(buffer, MAX_DECODE_ROWS)
    impls = [_impl(builder, buffer, leads) for leads in LEADERS]
    assert builder.num_ubatches == 1
    assert builder.ubatch_logical_topk.buffers == ()
    assert len(impls[2].index_group.ubatch_topk_states) == 0
    assert impls[2].index_group._topk_state() is impls[2].index_group


def test_dbo_ubatch_rejects_no_microbatches():
    """A builder needs at least one microbatch."""
    buffer = torch.empty((MAX_NUM_TOKENS, INDEX_TOPK), dtype=torch.int32)
    with pytest.raises(ValueError, match="num_ubatches must be >= 1"):
        SparseMLAIndexGroupBuilder(buffer, MAX_DECODE_ROWS, num_ubatches=0)


def test_dbo_ubatch_hisparse_followers_are_refused():
    """HiSparse stages top-k with no microbatch dimension: no followers under DBO."""
    buffer = torch.empty((MAX_NUM_TOKENS, INDEX_TOPK), dtype=torch.int32)
    builder = SparseMLAIndexGroupBuilder(buffer, MAX_DECODE_ROWS, num_ubatches=2)
    builder.current_group = HiSparseMLAIndexGroup.__new__(HiSparseMLAIndexGroup)
    with pytest.raises(ValueError, match="HiSparse cannot run with dual batch overlap"):
        builder.register_layer(False)
