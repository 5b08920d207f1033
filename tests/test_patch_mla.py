"""The torch.compile'd DSA path (deepseek_v2 / glm4_moe_lite): one DBO step
through vLLM's MultiHeadLatentAttentionWrapper, its Indexer, the registered
`torch.ops.vllm.sparse_attn_indexer` op called from a compiled graph, and the
sparse MLA impls sharing one group builder.

Each layer is the real wrapper built by its own __init__; only MLAAttention is
reduced to its impl (the sparse backend and projections a CPU cannot build)
and the op's kernel body is faked. The leader's writer is compiled once,
before the step (the last test compiles inside a microbatch thread, as vLLM's
first forward under DBO does), and then runs in both microbatch threads. Its
ready event is recorded the way the traced graph records it: the event the
tracer saw, in every microbatch. Layers 0 and 1 lead, 2 and 3 follow 1.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from vllm_dsa_dbo.cpu_dbo import (
    MAX_DECODE_ROWS,
    MAX_NUM_BATCHED_TOKENS,
    FakeStream,
    SharedTopkStack,
    make_impl,
    step_inputs,
)

LEADERS = [True, True, False, False]
HF_CONFIG = SimpleNamespace(
    index_topk=128, index_n_heads=2, index_head_dim=128, qk_rope_head_dim=64
)
HIDDEN = 64


def mla_attention(builder, buffer):
    """vLLM's MLAAttention reduced to the sparse impl it builds."""

    def build(*, prefix, indexer, **kwargs) -> nn.Module:
        module = nn.Module()
        module.layer_name = prefix
        module.impl = make_impl(builder, buffer, indexer is not None, indexer)
        return module

    return build


def build_layers(
    monkeypatch, vllm_env, enable_dbo: bool, platform: str = "cuda"
) -> tuple[nn.ModuleList, torch.Tensor]:
    """The layers, sharing one builder built as deepseek_v2.py builds it: without a count."""
    from vllm.config import CacheConfig
    from vllm.model_executor.layers import mla
    from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    from vllm_dsa_dbo.patches import mla as mla_patch

    buffer = torch.full((MAX_NUM_BATCHED_TOKENS, HF_CONFIG.index_topk), -1, dtype=torch.int32)
    monkeypatch.setattr(vllm_env.parallel_config, "enable_dbo", enable_dbo)
    builder = SparseMLAIndexGroupBuilder(buffer, MAX_DECODE_ROWS)
    monkeypatch.setattr(vllm_env.compilation_config, "static_forward_context", {})
    monkeypatch.setattr(mla, "MLAAttention", mla_attention(builder, buffer))
    monkeypatch.setattr(
        mla_patch, "current_platform", SimpleNamespace(is_cuda=lambda: platform == "cuda")
    )
    indexer_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=64),
        attention_config=SimpleNamespace(sparse_mla_prefill_workspace_factor=1),
    )
    layers = nn.ModuleList()
    for i, leads in enumerate(LEADERS):
        prefix = f"model.layers.{i}.self_attn"
        indexer = None
        if leads:
            indexer = Indexer(
                indexer_config,
                HF_CONFIG,
                HIDDEN,
                32,
                None,
                CacheConfig(),
                buffer,
                f"{prefix}.indexer",
            )
        modules = MLAModules(
            kv_a_layernorm=None,
            kv_b_proj=None,
            rotary_emb=None,
            o_proj=None,
            fused_qkv_a_proj=None,
            kv_a_proj_with_mqa=None,
            q_a_layernorm=None,
            q_b_proj=None,
            q_proj=None,
            indexer=indexer,
            is_sparse=True,
            topk_indices_buffer=buffer,
            index_group_builder=builder,
        )
        layers.append(
            MultiHeadLatentAttentionWrapper(
                HIDDEN,
                1,
                1.0,
                128,
                64,
                128,
                32,
                512,
                modules,
                prefix=prefix,
                skip_topk=not leads,
            )
        )
    return layers, buffer


class CompiledStack(SharedTopkStack):
    """The wrapper layers; a leader writes through its indexer op from a
    compiled graph and records the ready event the traced graph records."""

    def __init__(self, layers: nn.ModuleList, buffer: torch.Tensor, monkeypatch) -> None:
        from vllm.model_executor.layers import sparse_attn_indexer

        from vllm_dsa_dbo.patches.sparse_attn_indexer import closure_cell

        self.leaders = LEADERS
        self.device = "cpu"
        self.buffer = buffer
        self.impls = [layer.mla_attn.impl for layer in layers]
        self.inputs, self.metadata = step_inputs(LEADERS)
        self.op_buffers: list[int] = []
        # The op's body: vLLM's wrapper holds it in `fn`, or holds the plugin's
        # per-microbatch choice, which holds it in `kernel`.
        cell = closure_cell(sparse_attn_indexer.sparse_attn_indexer, "fn")
        if "kernel" in cell.cell_contents.__code__.co_freevars:
            cell = closure_cell(cell.cell_contents, "kernel")
        monkeypatch.setattr(cell, "cell_contents", self._indexer_kernel)
        self.writers = {}
        self.traced_ready = {}
        for i, layer in enumerate(layers):
            if LEADERS[i]:
                op = layer.indexer.indexer_op
                self.writers[i] = torch.compile(
                    lambda h, op=op: op.forward_cuda(h, h, h, h), fullgraph=True, backend="eager"
                )
                self._pending = torch.zeros(0, HF_CONFIG.index_topk, dtype=torch.int32)
                self.writers[i](torch.zeros(0, HIDDEN))  # traced here, outside microbatches
                self.traced_ready[i] = self.impls[i].index_group.logical_topk_ready
        self.op_buffers.clear()

    def _indexer_kernel(self, *args, **kwargs) -> torch.Tensor:
        """sparse_attn_indexer's body: writes the pending top-k into the
        buffer the op was handed."""
        buffer = args[13]
        buffer[: self._pending.shape[0]] = self._pending
        self.op_buffers.append(buffer.data_ptr())
        return buffer

    def lead(self, layer: int, logical: torch.Tensor) -> None:
        from vllm.utils.torch_utils import current_stream

        self._pending = logical
        self.writers[layer](torch.zeros(logical.shape[0], HIDDEN))
        self.traced_ready[layer].record(current_stream())


def test_compiled_dsa_followers_read_their_own_leaders_topk(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    layers, buffer = build_layers(monkeypatch, fake_gpu, enable_dbo=True)
    stack = CompiledStack(layers, buffer, monkeypatch)

    reads = stack.run_step()

    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == []
    assert len(reads) == 8 and len(set(stack.op_buffers)) == 2
    # Every wait is on an event the waiting microbatch recorded.
    assert [(u, by) for u, _, by in FakeStream.waits if u != by] == []
    check_wired(layers, num_ubatches=2)
    assert "2 microbatches, 1 index groups with followers" in describe(layers)


def test_compiled_dsa_without_dbo_allocates_nothing(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    layers, _ = build_layers(monkeypatch, fake_gpu, enable_dbo=False)
    check_wired(layers, num_ubatches=1)
    assert describe(layers) is None


def test_compiled_dsa_off_cuda_is_refused(fake_gpu, monkeypatch):
    """Off CUDA (ROCm) the leader writes through another op: left unwired, refused."""
    from vllm_dsa_dbo.diagnostics.refusals import check_wired

    layers, _ = build_layers(monkeypatch, fake_gpu, enable_dbo=True, platform="rocm")
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        check_wired(layers, num_ubatches=2)


def test_traced_code_reads_microbatch_0s_group_state(fake_gpu, monkeypatch):
    """vLLM compiles a model on its first forward, which under DBO runs in a
    microbatch thread: traced reads of the group's state (through its fields, or the lookup
    a vLLM carrying the upstream change calls) must neither break the graph (fullgraph) on
    the thread lookup nor pick that microbatch's copy."""
    from vllm_dsa_dbo.core import extra_topk_states
    from vllm_dsa_dbo.cpu_dbo import run_dbo_step

    layers, _ = build_layers(monkeypatch, fake_gpu, enable_dbo=True)
    group = layers[2].mla_attn.impl.index_group
    ubatch0 = group._topk_state().valid_topk_counts
    traced = {}

    def read(x: torch.Tensor) -> torch.Tensor:
        return x + group._topk_state().valid_topk_counts[0] + group.valid_topk_counts[1]

    def step(ubatch: int) -> None:
        if ubatch == 1:
            compiled = torch.compile(read, fullgraph=True, backend="eager")
            ubatch0[:2] = torch.tensor([7, 1])
            group._topk_state().valid_topk_counts[:2] = 5
            try:
                traced["value"] = int(compiled(torch.zeros(())))
            except torch._dynamo.exc.Unsupported as e:  # a graph break
                traced["graph break"] = str(e).splitlines()[0]

    run_dbo_step(step)
    assert extra_topk_states(group)[0].valid_topk_counts is not ubatch0
    assert traced == {"value": 8}
