"""DeepSeek-V4.1 (CUDA path): index sources hand their top-k to the layers
above them, and the candidate source hands its candidate blocks to later
indexers, in model-wide buffers; one DBO step through vLLM's DeepseekV4Model,
DeepseekV4Indexer, its SparseAttnIndexer op and the FlashMLA attention layer.

DeepseekV4Model is built by its own __init__ with decoder layers reduced to
the attention state DeepseekV4Attention.__init__ builds (its topology and
buffers, and vLLM's indexer on index sources), minus the projections, caches
and backend a CPU cannot build. Faked: the indexer kernel (writes a top-k and
candidates unique to its microbatch and layer) and the attention kernel
(`forward_mqa`: records the top-k it would attend over).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_yield

from vllm_dsa_dbo import cpu_dbo

INDEX_TOPK = 16
CANDIDATE_TOPK_BLOCKS = 4
MAX_NUM_BATCHED_TOKENS = 32
TOKENS_PER_UBATCH = (6, 4)
# Layer 0: index, KV and candidate source; 1 reuses 0's top-k; 2 indexes
# over 0's candidates; 3 reuses 2's top-k. Layer 3 is a KV source, so the
# model's decoder replay (past the last KV source) stays off.
HF_CONFIG = dict(
    num_hidden_layers=4,
    compress_ratios=[1, 1, 1, 1],
    kv_source_layer_ids=[0, 3],
    index_source_layer_ids=[0, 2],
    candidate_source_layer_id=0,
    candidate_topk_blocks=CANDIDATE_TOPK_BLOCKS,
    candidate_block_size=8,
    index_topk=INDEX_TOPK,
    index_n_heads=2,
    index_head_dim=128,
    qk_rope_head_dim=64,
    head_dim=128,
    q_lora_rank=32,
    vocab_size=64,
    hidden_size=64,
    rms_norm_eps=1e-6,
    hc_eps=1e-6,
    hc_mult=1,
    sliding_window=8,
)
# (layer, the layer whose top-k it reads, the layer whose candidates its indexer reads)
READS = [(0, 0, None), (1, 0, None), (2, 2, 0), (3, 2, None)]


def topk_of(ubatch: int, layer: int) -> torch.Tensor:
    """A top-k unique to one index source in one microbatch."""
    g = torch.Generator().manual_seed(100 * ubatch + layer)
    return torch.randint(0, 512, (TOKENS_PER_UBATCH[ubatch], INDEX_TOPK), generator=g).int()


def candidates_of(ubatch: int, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 100 * ubatch + layer)
    shape = (TOKENS_PER_UBATCH[ubatch], CANDIDATE_TOPK_BLOCKS)
    return torch.randint(0, 64, shape, generator=g).int()


class DecoderLayer(nn.Module):
    """A DeepseekV4DecoderLayer reduced to its attention's index state, set as
    DeepseekV4Attention.__init__ sets it; vLLM's DeepseekV4Indexer on index
    sources."""

    def __init__(
        self, vllm_config, prefix, topk_indices_buffer=None, candidate_block_buffer=None, **kwargs
    ) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.models.deepseek_v41.attention import DeepseekV4Indexer, DeepseekV4IndexerCache
        from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

        super().__init__()
        config = vllm_config.model_config.hf_config
        layer_id = extract_layer_index(prefix)
        attn = DeepseekV4FlashMLAAttention.__new__(DeepseekV4FlashMLAAttention)
        nn.Module.__init__(attn)
        attn.layer_id = layer_id
        attn.compress_ratio = config.compress_ratios[layer_id]
        attn.candidate_source_layer = config.candidate_source_layer_id
        attn.is_kv_source = layer_id in config.kv_source_layer_ids
        attn.is_index_source = layer_id in config.index_source_layer_ids
        attn.index_source_layer_id = max(s for s in config.index_source_layer_ids if s <= layer_id)
        attn.topk_indices_buffer = topk_indices_buffer
        attn.candidate_block_buffer = candidate_block_buffer
        attn.indexer = None
        if attn.is_index_source:
            kv_source = max(s for s in config.kv_source_layer_ids if s <= layer_id)
            k_cache = vllm_config.compilation_config.static_forward_context.get(
                f"model.layers.{kv_source}.attn.indexer.k_cache"
            ) or DeepseekV4IndexerCache(
                132, torch.uint8, f"{prefix}.attn.indexer.k_cache", vllm_config.cache_config
            )
            reads = 0 <= attn.candidate_source_layer <= layer_id
            attn.indexer = DeepseekV4Indexer(
                vllm_config,
                config,
                config.hidden_size,
                config.q_lora_rank,
                None,
                vllm_config.cache_config,
                topk_indices_buffer,
                attn.compress_ratio,
                f"{prefix}.attn.indexer",
                owns_k=attn.is_kv_source,
                k_cache=k_cache,
                main_head_dim=config.head_dim,
                candidate_block_buffer=candidate_block_buffer if reads else None,
                candidate_block_size=config.candidate_block_size,
                candidate_write=layer_id == attn.candidate_source_layer,
            )
            # What CustomOp dispatches to on CUDA.
            attn.indexer.indexer_op._forward_method = attn.indexer.indexer_op.forward_cuda
        self.attn = attn


def build_v41_model(monkeypatch, vllm_env, enable_dbo: bool) -> nn.Module:
    from vllm.config import CacheConfig
    from vllm.models.deepseek_v41.nvidia import model as v41_model

    monkeypatch.setattr(vllm_env.parallel_config, "enable_dbo", enable_dbo)
    monkeypatch.setattr(vllm_env.compilation_config, "static_forward_context", {})
    monkeypatch.setattr(vllm_env.attention_config, "sparse_mla_prefill_workspace_factor", 1)
    monkeypatch.setattr(v41_model, "DeepseekV4DecoderLayer", DecoderLayer)
    monkeypatch.setattr(torch.cuda, "Stream", cpu_dbo.FakeStream)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(**HF_CONFIG), max_model_len=64, dtype=torch.float32
        ),
        cache_config=CacheConfig(),
        quant_config=None,
        parallel_config=vllm_env.parallel_config,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS),
        kernel_config=vllm_env.kernel_config,
        attention_config=vllm_env.attention_config,
        compilation_config=vllm_env.compilation_config,
        engram_config=None,
        speculative_config=None,
        kv_transfer_config=None,
    )
    return v41_model.DeepseekV4Model(vllm_config=vllm_config, prefix="model")


class V41Step:
    """One DBO step: each microbatch runs every layer's vLLM
    `_sparse_indexer_and_attn` and yields after it, as the MoE does."""

    def __init__(self, model: nn.Module, monkeypatch) -> None:
        from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

        self.attns = [layer.attn for layer in model.layers]
        self.layer_of_ubatch: dict[int, int] = {}
        # (ubatch, layer) -> what it read
        self.topk_reads: dict[tuple[int, int], torch.Tensor] = {}
        self.candidate_reads: dict[tuple[int, int], torch.Tensor] = {}
        monkeypatch.setattr(torch.ops.vllm, "sparse_attn_indexer", self._indexer_kernel)
        monkeypatch.setattr(
            DeepseekV4FlashMLAAttention,
            "forward_mqa",
            lambda attn, q, kv, positions, output: self._attention_kernel(attn),
        )

    def _indexer_kernel(self, *args, candidate_blocks=None, candidate_write=False, **kwargs):
        """torch.ops.vllm.sparse_attn_indexer: masks with the candidates it is
        handed (or writes its own), then writes its top-k."""
        ubatch = dbo_current_ubatch_id()
        layer = self.layer_of_ubatch[ubatch]
        n = TOKENS_PER_UBATCH[ubatch]
        if candidate_write:
            candidate_blocks[:n] = candidates_of(ubatch, layer)
        elif candidate_blocks is not None:
            self.candidate_reads[ubatch, layer] = candidate_blocks[:n].clone()
        buffer = args[13]
        buffer[:n] = topk_of(ubatch, layer)
        return buffer

    def _attention_kernel(self, attn: nn.Module) -> None:
        """`forward_mqa`: reads the top-k it attends over."""
        ubatch = dbo_current_ubatch_id()
        n = TOKENS_PER_UBATCH[ubatch]
        self.topk_reads[ubatch, attn.layer_id] = attn.topk_indices_buffer[:n].clone()

    def run(self) -> list[tuple[int, int, str]]:
        """The (microbatch, layer, state) reads that are not their own."""
        cpu_dbo.run_dbo_step(self._ubatch)
        wrong = []
        for ubatch in range(2):
            for layer, topk_source, candidate_source in READS:
                read = self.topk_reads[ubatch, layer]
                if not torch.equal(read, topk_of(ubatch, topk_source)):
                    wrong.append((ubatch, layer, "top-k"))
                if candidate_source is not None:
                    read = self.candidate_reads[ubatch, layer]
                    if not torch.equal(read, candidates_of(ubatch, candidate_source)):
                        wrong.append((ubatch, layer, "candidates"))
        return wrong

    def _ubatch(self, ubatch: int) -> None:
        n = TOKENS_PER_UBATCH[ubatch]
        hidden = torch.zeros(n, 64)
        for attn in self.attns:
            self.layer_of_ubatch[ubatch] = attn.layer_id
            index_q = hidden if attn.indexer is not None else None
            attn._sparse_indexer_and_attn(
                hidden, index_q, None, hidden, hidden, hidden, torch.arange(n), hidden
            )
            dbo_yield()


def test_deepseek_v41_reusing_layers_read_their_own_ubatch_state(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    model = build_v41_model(monkeypatch, fake_gpu, enable_dbo=True)
    step = V41Step(model, monkeypatch)

    assert step.run() == []
    assert len(step.topk_reads) == 8 and len(step.candidate_reads) == 2
    check_wired(model, 2)
    line = describe(model)
    per_ubatch = MAX_NUM_BATCHED_TOKENS * (INDEX_TOPK + CANDIDATE_TOPK_BLOCKS) * 4
    assert line is not None and f"{per_ubatch:,} bytes" in line


def test_deepseek_v41_stock_buffers_cross_microbatches(fake_gpu, monkeypatch):
    """The same step without the copies: microbatch 0's reusing layers read
    microbatch 1's top-k and candidates, and the loader refuses the model."""
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.patches import deepseek_v41_model

    monkeypatch.setattr(deepseek_v41_model, "handed_off_buffers", lambda model: [])
    model = build_v41_model(monkeypatch, fake_gpu, enable_dbo=True)

    assert V41Step(model, monkeypatch).run() == [
        (0, 1, "top-k"),
        (0, 2, "candidates"),
        (0, 3, "top-k"),
    ]
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        check_wired(model, 2)


def test_deepseek_v41_without_dbo_allocates_nothing(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe
    from vllm_dsa_dbo.ubatch_buffers import ubatch_copies

    model = build_v41_model(monkeypatch, fake_gpu, enable_dbo=False)
    assert ubatch_copies(model.topk_indices_buffer) == []
    assert ubatch_copies(model.candidate_block_buffer) == []
    check_wired(model, 1)
    assert describe(model) is None
    op = model.layers[0].attn.indexer.indexer_op
    assert op.topk_indices_buffer is model.topk_indices_buffer
    assert op.candidate_blocks is model.candidate_block_buffer


def test_deepseek_v41_rebound_buffer_resolves_to_itself(fake_gpu, monkeypatch):
    """vLLM's indexer API rebinds an op's buffer at run time: a buffer with no
    copies is used as given in every microbatch."""
    model = build_v41_model(monkeypatch, fake_gpu, enable_dbo=True)
    op = model.layers[0].attn.indexer.indexer_op
    rebound = torch.empty_like(model.topk_indices_buffer)
    op.topk_indices_buffer = rebound
    seen: dict[int, torch.Tensor] = {}
    cpu_dbo.run_dbo_step(lambda ubatch: seen.setdefault(ubatch, op.topk_indices_buffer))
    assert seen[0] is rebound and seen[1] is rebound
    assert model.layers[1].attn.topk_indices_buffer is model.topk_indices_buffer


def checked_step(model: nn.Module, monkeypatch, mode: str):
    """The DBO step with the isolation checker's V4.1 hooks in place."""
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    from vllm_dsa_dbo.diagnostics.isolation import IsolationChecker, checked_v41_layer

    checker = IsolationChecker(mode)
    stock = DeepseekV4Attention._sparse_indexer_and_attn
    monkeypatch.setattr(
        DeepseekV4Attention, "_sparse_indexer_and_attn", checked_v41_layer(checker, stock)
    )
    return checker, V41Step(model, monkeypatch).run()


def test_deepseek_v41_isolation_checker_silent_with_the_fix(fake_gpu, monkeypatch):
    model = build_v41_model(monkeypatch, fake_gpu, enable_dbo=True)
    checker, wrong = checked_step(model, monkeypatch, "raise")
    assert wrong == [] and not checker.violations
    assert checker.checked_reads == 6  # per microbatch: layers 1 and 3's top-k, 2's candidates


def test_deepseek_v41_isolation_checker_counts_stock_cross_reads(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.patches import deepseek_v41_model

    monkeypatch.setattr(deepseek_v41_model, "handed_off_buffers", lambda model: [])
    model = build_v41_model(monkeypatch, fake_gpu, enable_dbo=True)
    checker, wrong = checked_step(model, monkeypatch, "audit")
    assert len(wrong) == 3
    assert dict(checker.violations) == {
        ("V4.1 layer 0", "V4.1 layer 1", "V4.1 top-k"): 1,
        ("V4.1 layer 0", "V4.1 layer 2", "V4.1 candidate blocks"): 1,
        ("V4.1 layer 2", "V4.1 layer 3", "V4.1 top-k"): 1,
    }


def test_deepseek_v41_memory_formula_is_what_the_model_allocates(
    fake_gpu, monkeypatch, tmp_path, capsys
):
    import json

    from vllm_dsa_dbo import cli
    from vllm_dsa_dbo.diagnostics.startup import copied_buffers
    from vllm_dsa_dbo.ubatch_buffers import ubatch_copies

    model = build_v41_model(monkeypatch, fake_gpu, enable_dbo=True)
    copies = [c for b in copied_buffers(model) for c in ubatch_copies(b)]
    allocated = sum(c.numel() * c.element_size() for c in copies)

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["DeepseekV41ForCausalLM"], **HF_CONFIG}))
    args = ["memory", "--config", str(config), "--max-num-batched-tokens", "32"]
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["followers"] == 3  # layers 1 and 3 reuse top-k, 2's indexer candidates
    assert report["copied_buffers"] == {
        "top-k buffer": INDEX_TOPK,
        "candidate-block buffer": CANDIDATE_TOPK_BLOCKS,
    }
    assert report["bytes_per_extra_ubatch"] == allocated
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"extra bytes per GPU per extra microbatch: {allocated:,}" in out
    assert "followers (3, reading another layer's top-k or candidate blocks): 1 2 3" in out
    assert "  candidate-block buffer 32 x 4 x 4 = 512" in out
    assert cli.main([*args, "--num-ubatches", "1"]) == 0
    assert "extra memory: 0 bytes; no DBO: nothing allocated" in capsys.readouterr().out
