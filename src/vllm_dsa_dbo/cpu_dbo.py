"""What `vllm-dsa-dbo demo` runs (the tests and benches too): one DBO step through a
GLM-5-shaped stack of vLLM's real sparse MLA layers, on a CPU.

All of it is vLLM's own code (microbatch threads, index groups, sparse MLA impls, the
Triton top-k conversion, interpreted) but CUDA streams and events, which get stand-ins;
call `vllm_dsa_dbo.demo.use_cpu()` before vLLM is imported. Each leader writes a top-k
unique to its layer and microbatch, and each layer reads its top-k as the attention
does: what each read matches tells whose top-k each follower attended over.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl
from vllm.models.deepseek_v32.attention import DeepseekV32Attention
from vllm.utils import torch_utils
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder
from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_yield, make_ubatch_contexts

from vllm_dsa_dbo.patches._shared import run_after_init


class FakeEvent:
    """Remembers which microbatch recorded it last."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.recorded_by: int | None = None

    def record(self, stream: object = None) -> None:
        self.recorded_by = dbo_current_ubatch_id()


class FakeStream:
    """Logs every event wait as (waiting microbatch, event, its recorder)."""

    waits: list[tuple[int, FakeEvent, int | None]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._outer: list[object] = []

    def wait_event(self, event: FakeEvent) -> None:
        FakeStream.waits.append((dbo_current_ubatch_id(), event, event.recorded_by))

    def wait_stream(self, stream: object) -> None:
        pass

    def __enter__(self) -> FakeStream:
        self._outer.append(torch_utils.current_stream())
        set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        set_stream(self._outer.pop())


def set_stream(stream: object) -> None:
    torch_utils._current_stream_tls.value = stream


@contextmanager
def fake_streams() -> Iterator[None]:
    """torch's stream and event constructors make the CPU stand-ins."""
    saved = torch.Event, torch.Stream, torch.cuda.set_stream
    FakeStream.waits = []
    torch.Event, torch.Stream, torch.cuda.set_stream = FakeEvent, FakeStream, set_stream
    set_stream(FakeStream())
    try:
        yield
    finally:
        torch.Event, torch.Stream, torch.cuda.set_stream = saved
        set_stream(None)


@contextmanager
def cpu_vllm() -> Iterator[object]:
    """A CPU vLLM config in force and a one-rank gloo world, as a worker has."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            with socket.socket() as free:  # a free port, for gloo to bind
                free.bind(("127.0.0.1", 0))
                port = free.getsockname()[1]
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        yield config


def run_dbo_step(step: Callable[[int], None], num_ubatches: int = 2, stream: object = None) -> None:
    """Run `step(ubatch_id)` in vLLM's microbatch threads, as UBatchWrapper does: each in
    a real `UBatchContext` at its first row of the batch (`TOKENS_PER_UBATCH`), where
    `dbo_yield()` hands over as the MoE's dispatch does.
    `stream`: the shared compute/comm stream (a CUDA stream on a GPU; a stand-in here)."""
    from vllm import forward_context
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import create_forward_context

    stream = FakeStream() if stream is None else stream
    barrier = threading.Barrier(num_ubatches + 1)
    config = get_current_vllm_config()
    contexts = make_ubatch_contexts(
        num_ubatches,
        compute_stream=stream,
        comm_stream=stream,
        forward_contexts=[create_forward_context(None, config) for _ in range(num_ubatches)],
        ready_barrier=barrier,
        token_offsets=[sum(TOKENS_PER_UBATCH[:i]) for i in range(num_ubatches)],
    )
    errors: list[BaseException] = []

    def thread_main(context) -> None:
        if isinstance(stream, FakeStream):
            set_stream(stream)
        else:
            torch.cuda.set_stream(stream)
        try:
            with context:
                step(context.id)
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=thread_main, args=(c,), daemon=True) for c in contexts]
    # Each context sets vLLM's one global forward context; the step's caller
    # gets its own back, as vLLM's outer set_forward_context gives it.
    outer = forward_context._forward_context
    try:
        for t in threads:
            t.start()
        barrier.wait()
        contexts[0].cpu_wait_event.set()
        # A microbatch that raises leaves its peer waiting at its next yield, as
        # in vLLM: report the error rather than wait for the peer.
        deadline = time.monotonic() + 60
        while (alive := [t for t in threads if t.is_alive()]) and not errors:
            if time.monotonic() > deadline:
                raise RuntimeError("a microbatch thread hung")
            alive[0].join(0.01)
    finally:
        forward_context._forward_context = outer
    if errors:
        raise errors[0]


INDEX_TOPK = 128
BLOCK_SIZE = 64
MAX_NUM_BATCHED_TOKENS = 32
QK_ROPE_HEAD_DIM = 64
# Different lengths and requests per microbatch, so a wrong read shows.
TOKENS_PER_UBATCH = (6, 4)
REQS_PER_UBATCH = (2, 3)
# vLLM's converted rows hold a whole decode step, so each microbatch fits from its offset.
MAX_DECODE_ROWS = sum(TOKENS_PER_UBATCH)
# What a leader's padded decode rows hold (a valid top-k entry, no leader's).
PADDING = 0


@dataclass(frozen=True)
class Source:
    """The leader write a read came from."""

    ubatch: int
    leader: int

    def __str__(self) -> str:
        return f"microbatch {self.ubatch}, leader {self.leader}"


@dataclass(frozen=True)
class Read:
    """What one layer read in one microbatch, and whose it should have been."""

    layer: int
    ubatch: int
    expected: Source
    logical: Source | None
    physical: Source | None

    @property
    def ok(self) -> bool:
        return self.logical == self.physical == self.expected


def make_impl(
    builder: SparseMLAIndexGroupBuilder | None,
    buffer: torch.Tensor,
    leads: bool,
    indexer: object | None = None,
    *,
    impl_cls: type = SparseMLACommonImpl,
    num_heads: int = 1,
    kv_cache_dtype: str = "auto",
    qk_nope_head_dim: int = 128,
    v_head_dim: int = 128,
) -> Any:
    """A real sparse MLA impl (`impl_cls`, any backend's) registered in `builder` as the
    model's layers are (no builder: the impl builds a private group, as HYV4's layers do)."""
    return impl_cls(
        num_heads=num_heads,
        head_size=576,
        scale=1.0,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype=kv_cache_dtype,
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_head_dim=qk_nope_head_dim + QK_ROPE_HEAD_DIM,
        v_head_dim=v_head_dim,
        kv_b_proj=None,
        # Leaders own an indexer; the impl then resolves the buffer through it.
        indexer=indexer or (SimpleNamespace(topk_indices_buffer=buffer) if leads else None),
        topk_indices_buffer=buffer,
        index_group_builder=builder,
    )


def attention_module(impl: SparseMLACommonImpl, buffer: torch.Tensor) -> nn.Module:
    """The `DeepseekV32Attention` state its leader's writers take the buffer from, as its
    `__init__` (with the plugin's hooks) leaves it."""
    attn = DeepseekV32Attention.__new__(DeepseekV32Attention)
    nn.Module.__init__(attn)
    attn.impl = impl
    attn.topk_indices_buffer = buffer
    run_after_init(attn)
    return attn


def metadata(ubatch: int, device: str = "cpu") -> SimpleNamespace:
    g = torch.Generator().manual_seed(1000 + ubatch)
    n, reqs = TOKENS_PER_UBATCH[ubatch], REQS_PER_UBATCH[ubatch]
    return SimpleNamespace(
        req_id_per_token=torch.randint(0, reqs, (n,), generator=g).int().to(device),
        block_table=torch.randperm(64, generator=g)[: reqs * 4].view(reqs, 4).int().to(device),
        block_size=BLOCK_SIZE,
        # vLLM 0.34.0's first top-k row of the step (ShardQ); 0 where it does not shard.
        topk_start=0,
    )


def logical_topk(source: Source, device: str = "cpu") -> torch.Tensor:
    """A top-k unique to one leader in one microbatch (-1 marks unused slots)."""
    g = torch.Generator().manual_seed(source.ubatch * 100 + source.leader)
    n = TOKENS_PER_UBATCH[source.ubatch]
    logical = torch.randint(0, 4 * BLOCK_SIZE, (n, INDEX_TOPK), generator=g)
    logical[torch.rand(n, INDEX_TOPK, generator=g) < 0.2] = -1
    return logical.int().to(device)


def physical_topk(source: Source, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's conversion kernel makes of `source`'s top-k, with its counts."""
    meta = metadata(source.ubatch, device)
    return triton_convert_req_index_to_global_index(
        meta.req_id_per_token,
        meta.block_table,
        logical_topk(source, device),
        BLOCK_SIZE=BLOCK_SIZE,
        NUM_TOPK_TOKENS=INDEX_TOPK,
        return_valid_counts=True,
    )


def step_inputs(
    leaders: list[bool], device: str = "cpu"
) -> tuple[dict[tuple[int, int], torch.Tensor], list[SimpleNamespace]]:
    """Every leader's top-k and each microbatch's metadata, on the device up front."""
    inputs = {
        (u, i): logical_topk(Source(u, i), device)
        for u in (0, 1)
        for i, leads in enumerate(leaders)
        if leads
    }
    return inputs, [metadata(u, device) for u in (0, 1)]


class SharedTopkStack:
    """Sparse MLA layers sharing one top-k builder, as `DeepseekV32Model` builds them;
    `num_ubatches=None` builds them as stock vLLM, whose builder takes no count."""

    def __init__(
        self,
        leaders: list[bool],
        num_ubatches: int | None,
        device: str = "cpu",
        max_decode_rows: int = MAX_DECODE_ROWS,
    ) -> None:
        self.leaders = leaders
        self.device = device
        self.buffer = torch.full(
            (MAX_NUM_BATCHED_TOKENS, INDEX_TOPK), -1, dtype=torch.int32, device=device
        )
        kwargs = {} if num_ubatches is None else {"num_ubatches": num_ubatches}
        self.builder = SparseMLAIndexGroupBuilder(self.buffer, max_decode_rows, **kwargs)
        self.impls = [make_impl(self.builder, self.buffer, leads) for leads in leaders]
        self.attns = [
            attention_module(impl, self.buffer) if leads else None
            for impl, leads in zip(self.impls, leaders)
        ]
        self.inputs, self.metadata = step_inputs(leaders, device)

    def leader_of(self, layer: int) -> int:
        return max(i for i in range(layer + 1) if self.leaders[i])

    def _read(self, layer: int, ubatch: int) -> tuple[torch.Tensor, ...]:
        """A sparse MLA impl's top-k reads, cloned at once."""
        impl, n = self.impls[layer], TOKENS_PER_UBATCH[ubatch]
        logical = impl.topk_indices_buffer[:n]
        physical, counts = impl._convert_logical_to_physical_topk(
            logical,
            self.metadata[ubatch],
            block_stride_rows=None,
            return_valid_counts=True,
        )
        return logical.clone(), physical.clone(), counts.clone()

    def lead(self, layer: int, logical: torch.Tensor) -> None:
        """A leader's writes, into the buffer its attention module hands its writers."""
        self.attns[layer].topk_indices_buffer[: logical.shape[0]] = logical
        self.impls[layer].record_logical_topk_ready()

    def pad(self, layer: int, rows: int, padding: int) -> None:
        """`padding` rows past a leader's own `rows`, as the indexer's padded decode path
        fills them."""
        self.attns[layer].topk_indices_buffer[rows : rows + padding] = PADDING

    def run_step(
        self,
        yield_from_layer: int = 0,
        stream: object = None,
        *,
        padding: int = 0,
        yield_after: Collection[int] | None = None,
    ) -> list[Read]:
        """One DBO step, yielding after each layer from `yield_from_layer` on (the MoE's), or
        after the layers `yield_after` names; each leader writes `padding` rows past its own."""
        return self.classify(self.run_reads(yield_from_layer, stream, padding, yield_after))

    def run_reads(
        self,
        yield_from_layer: int = 0,
        stream: object = None,
        padding: int = 0,
        yield_after: Collection[int] | None = None,
    ) -> dict[tuple[int, int], tuple[torch.Tensor, ...]]:
        """The step itself: what each (layer, microbatch) read."""
        raw: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        if yield_after is None:
            yield_after = range(yield_from_layer, len(self.leaders))

        def step(ubatch: int) -> None:
            for layer, leads in enumerate(self.leaders):
                if leads:
                    self.lead(layer, self.inputs[ubatch, layer])
                    if padding:
                        self.pad(layer, TOKENS_PER_UBATCH[ubatch], padding)
                raw[layer, ubatch] = self._read(layer, ubatch)
                if layer in yield_after:
                    dbo_yield()

        run_dbo_step(step, stream=stream)
        return raw

    def classify(self, raw: dict[tuple[int, int], tuple[torch.Tensor, ...]]) -> list[Read]:
        """Whose write each read of `run_reads` matches, bit for bit."""
        written = {
            Source(u, i): (logical, *physical_topk(Source(u, i), self.device))
            for (u, i), logical in self.inputs.items()
        }

        def match(read: tuple[torch.Tensor, ...], part: slice) -> Source | None:
            return next(
                (s for s, w in written.items() if all(map(_same, read[part], w[part]))),
                None,
            )

        return [
            Read(
                layer=layer,
                ubatch=u,
                expected=Source(u, self.leader_of(layer)),
                logical=match(raw[layer, u], slice(0, 1)),
                # the converted rows and their valid counts
                physical=match(raw[layer, u], slice(1, 3)),
            )
            for layer, u in sorted(raw)
        ]


def _same(read: torch.Tensor, written: torch.Tensor) -> bool:
    """Bit-for-bit equal on the rows both have."""
    rows = min(read.shape[0], written.shape[0])
    return torch.equal(read[:rows], written[:rows])


# GLM-5.x's layout in 8 layers; 3 dense layers first, so the first MoE yield follows layer 3.
GLM5_LAYOUT = {"num_hidden_layers": 8, "index_topk_freq": 4, "index_skip_topk_offset": 3}
FIRST_MOE_LAYER = 3
