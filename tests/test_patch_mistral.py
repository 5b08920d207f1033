"""Mistral Large 4 (vLLM 0.34.0, `index_sharing`): leaders hand the logical top-k to their
"shared" followers through one SparseMLAIndexGroupBuilder; one DBO step through vLLM's
MistralLarge4Model, MistralMLAAttention, MistralIndexer and its SparseAttnIndexer op, and
FlashMLASparseImpl.

The config is vLLM's own adapter's (`adapt_config_dict`) of a Mistral `params.json` with
`dsa.sharing`. MistralLarge4Model is built by its own __init__ with decoder layers reduced to
the MistralMLAAttention their __init__ builds (the MLP / MoE only yields, as the step does).
Faked, because a CPU has none: CUDA streams and events (`cpu_dbo`), the fused kernels the
indexer calls (the Q launch clears the top-k rows it is handed, as its kernel does), the
indexer op's kernel `torch.ops.vllm.sparse_attn_indexer` (writes the top-k this test gives it
into the buffer it is handed), the query projection, and the attention call, which reads the
top-k through its impl as FlashMLASparseImpl.forward_mqa does. The op dispatches as on CUDA
(forward_cuda). The indexer runs fused, as on CUDA with one data-parallel rank (its Q launch
clears the rows the op then fills), or unfused (DBO needs several data-parallel ranks, and
there vLLM leaves the clear to the op). Layers 0 and 1 lead, 2 and 3 follow 1.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn as nn

from ubatch_rows import address, ubatch1_logical
from vllm_dsa_dbo import patches
from vllm_dsa_dbo.cpu_dbo import TOKENS_PER_UBATCH, FakeStream, SharedTopkStack, step_inputs
from vllm_dsa_dbo.patches import mistral_attention

pytestmark = pytest.mark.skipif(
    not patches.matters(mistral_attention.PATCH),
    reason="this vLLM has no Mistral Large 4 (vLLM 0.34.0 added it)",
)

LEADERS = [True, True, False, False]
MAX_NUM_BATCHED_TOKENS = 32
# A Mistral params.json: Mistral Large 4's DSA and MoE keys, four layers, two of them
# reusing layer 1's top-k ("sharing", an alias of "index_sharing").
PARAMS = {
    "dim": 64,
    "n_layers": 4,
    "n_heads": 16,
    "n_kv_heads": 16,
    "head_dim": 192,
    "hidden_dim": 128,
    "norm_eps": 1e-5,
    "vocab_size": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "yarn": {
        "factor": 1.0,
        "original_max_position_embeddings": 4096,
        "beta": 32.0,
        "alpha": 1.0,
        "apply_scale": False,
    },
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "moe": {
        "num_experts": 4,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "expert_hidden_dim": 32,
        "first_k_dense_replace": 4,
        "route_every_n": 1,
        "routed_scale": 1.0,
    },
    "dsa": {
        "topk": 128,
        "n_heads": 2,
        "head_dim": 128,
        "norm_eps": 1e-6,
        "ssmax_scaling": True,
        "sharing": "full,full,shared,shared",
    },
}


def hf_config(sharing: str = PARAMS["dsa"]["sharing"]):
    """The HF config vLLM's Mistral config parser makes of PARAMS."""
    from vllm.transformers_utils.configs.mistral import adapt_config_dict

    params = copy.deepcopy(PARAMS)  # the adapter pops what it reads
    params["dsa"]["sharing"] = sharing
    return adapt_config_dict(params, defaults={})


def model_module(platform: str) -> ModuleType:
    """vLLM's `mistral_large4/<platform>/model.py`, imported without its package's platform
    dispatch (it raises on a CPU)."""
    package = "vllm.models.mistral.mistral_large4"
    if package not in sys.modules:
        parent = Path(importlib.util.find_spec("vllm.models.mistral").origin).parent
        stub = ModuleType(package)
        stub.__path__ = [str(parent / "mistral_large4")]
        sys.modules[package] = stub
    return importlib.import_module(f"{package}.{platform}.model")


class CudaEvent:
    """torch.cuda.Event on a CPU: the indexer's K-projection join, within one layer."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


def no_prefill_backend(*args, **kwargs):
    raise ValueError("no MLA prefill backend on this CPU")


def reduced_decoder_layer(attention_cls: type) -> type:
    class DecoderLayer(nn.Module):
        """A MistralLarge4DecoderLayer reduced to the MistralMLAAttention it builds."""

        def __init__(self, vllm_config, config, spec, prefix, **kwargs) -> None:
            super().__init__()
            self.self_attn = attention_cls(
                vllm_config, config, spec, prefix=f"{prefix}.self_attn", **kwargs
            )

    return DecoderLayer


def build_model(
    monkeypatch,
    vllm_env,
    *,
    enable_dbo: bool,
    fused: bool = True,
    platform: str = "nvidia",
    backend: str = "FLASHMLA_SPARSE",
    loaded: bool = False,
    index_sharing: list[str] | None = None,
) -> nn.Module:
    """MistralLarge4Model of `platform` as its __init__ builds it, on `backend`'s impl; with
    `loaded`, through the loader's initialize_model, as a worker builds it; `index_sharing`
    as an HF config.json may write it, unvalidated."""
    from vllm.config import CompilationMode
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.model_executor.model_loader import base_loader
    from vllm.v1.attention.backends.mla import flashmla_sparse
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker import workspace

    model = model_module(platform)
    attention = importlib.import_module(f"vllm.models.mistral.{platform}.attention")
    indexer = importlib.import_module(f"vllm.models.mistral.{platform}.indexer")
    hf = hf_config()
    if index_sharing is not None:
        hf.index_sharing = index_sharing
    monkeypatch.setattr(vllm_env.parallel_config, "enable_dbo", enable_dbo)
    monkeypatch.setattr(vllm_env.compilation_config, "static_forward_context", {})
    monkeypatch.setattr(vllm_env.compilation_config, "mode", CompilationMode.NONE)
    monkeypatch.setattr(vllm_env.scheduler_config, "max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS)
    monkeypatch.setattr(vllm_env.attention_config, "sparse_mla_prefill_workspace_factor", 1)
    monkeypatch.setattr(
        vllm_env,
        "model_config",
        SimpleNamespace(max_model_len=64, dtype=torch.bfloat16, hf_config=hf, hf_text_config=hf),
    )
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"), 2)
    monkeypatch.setattr(torch.cuda, "Event", CudaEvent)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(flashmla_sparse, "num_compute_units", lambda *a: 132, raising=False)
    backend_cls = AttentionBackendEnum[backend].get_class()
    monkeypatch.setattr(mla_attention, "get_attn_backend", lambda *a, **k: backend_cls)
    monkeypatch.setattr(mla_attention, "get_mla_prefill_backend", no_prefill_backend)
    monkeypatch.setattr(indexer, "fusion_enabled", lambda name: fused)
    monkeypatch.setattr(
        model, "MistralLarge4DecoderLayer", reduced_decoder_layer(attention.MistralMLAAttention)
    )
    if loaded:
        return base_loader.initialize_model(
            vllm_env, model_class=model.MistralLarge4Model, model_config=vllm_env.model_config
        )
    return model.MistralLarge4Model(vllm_config=vllm_env, prefix="model")


class MistralStack(SharedTopkStack):
    """One DBO step through MistralMLAAttention.forward: a leader's MistralIndexer writes
    the top-k and its impl records it ready, then every layer's attention reads it."""

    def __init__(self, model: nn.Module, monkeypatch, leaders: list[bool] = LEADERS) -> None:
        from vllm.models.mistral.nvidia import attention, indexer

        self.model = model
        self.leaders = leaders
        self.device = "cpu"
        self.buffer = model.layers[0].self_attn.attn.impl._topk_indices_buffer
        self.attns = [layer.self_attn for layer in model.layers]
        self.impls = [attn.attn.impl for attn in self.attns]
        self.inputs, self.metadata = step_inputs(leaders)
        self.op_buffers: list[torch.Tensor] = []
        self.cleared: list[torch.Tensor] = []
        for attn in self.attns:
            if attn.indexer is not None:
                op = attn.indexer.indexer_op
                op._forward_method = op.forward_cuda  # CustomOp's dispatch on CUDA
        monkeypatch.setattr(torch.ops.vllm, "sparse_attn_indexer", self._indexer_kernel)
        monkeypatch.setattr(indexer, "layer_norm", lambda x, *args: x)
        monkeypatch.setattr(indexer, "fused_indexer_k_norm_rope_cache_write", lambda *a, **k: None)
        monkeypatch.setattr(indexer, "fused_indexer_q_ssmax_rope_quant", self._q_kernel)
        monkeypatch.setattr(indexer, "fused_indexer_q_rope_quant", lambda p, q, c, w, *a: (q, w))
        monkeypatch.setattr(attention.MistralMLAAttention, "_project_qkv", self._project_qkv)
        monkeypatch.setattr(
            attention._MistralMLA,
            "forward",
            lambda mla, *args, **kw: self._attention(mla, *args, **kw),
        )
        self._reads: dict[int, tuple[torch.Tensor, ...]] = {}

    def _q_kernel(self, positions, q, *args, topk_indices=None, **kwargs):
        """fused_indexer_q_ssmax_rope_quant: clears rows [:T] of `topk_indices`, if given."""
        if topk_indices is not None:
            topk_indices[: q.shape[0]] = -1
            self.cleared.append(topk_indices)
        return q, torch.zeros(q.shape[0], q.shape[1])

    def _indexer_kernel(self, *args, **kwargs) -> torch.Tensor:
        """torch.ops.vllm.sparse_attn_indexer: writes the pending top-k into the buffer
        the op was handed."""
        buffer = args[13]
        buffer[: self._pending.shape[0]] = self._pending
        self.op_buffers.append(buffer)
        return buffer

    @staticmethod
    def _project_qkv(attn, positions, hidden_states, log_positions, rotary_emb):
        n = hidden_states.shape[0]
        return (
            torch.zeros(n, attn.num_local_heads, attn.qk_head_dim + attn.qk_rope_head_dim),
            torch.zeros(n, attn.kv_lora_rank),
            torch.zeros(n, 1, attn.qk_rope_head_dim),
        )

    def _attention(self, mla, q, kv_c_normed, k_pe, output_shape=None, **kwargs):
        """The attention call: the top-k its impl's forward_mqa reads, logical and converted."""
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id

        ubatch = dbo_current_ubatch_id()
        impl, n = mla.impl, q.shape[0]
        logical = impl.topk_indices_buffer[:n]
        physical, counts = impl._convert_logical_to_physical_topk(
            logical, self.metadata[ubatch], block_stride_rows=None, return_valid_counts=True
        )
        self._reads[ubatch] = (logical.clone(), physical.clone(), counts.clone())
        return torch.zeros(output_shape)

    def lead(self, layer: int, logical: torch.Tensor) -> None:
        self._pending = logical

    def _read(self, layer: int, ubatch: int) -> tuple[torch.Tensor, ...]:
        n = TOKENS_PER_UBATCH[ubatch]
        positions = torch.arange(n)
        hidden = torch.zeros(n, 64)
        log_positions = torch.log(positions.float() + 1)
        self.attns[layer](positions, hidden, log_positions, self.model.rotary_emb)
        return self._reads.pop(ubatch)


def foreign_event_waits() -> list[tuple[int, int | None]]:
    """Ready-event waits on an event another microbatch recorded last."""
    return [(w, r) for w, _, r in FakeStream.waits if r is not None and r != w]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_mistral_followers_read_their_own_leaders_topk(fake_gpu, monkeypatch, fused):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    model = build_model(monkeypatch, fake_gpu, enable_dbo=True, fused=fused)
    stack = MistralStack(model, monkeypatch)
    groups = [impl.index_group for impl in stack.impls]
    assert [s.has_indexer for s in model.layer_specs] == LEADERS
    assert groups[1] is groups[2] is groups[3] and groups[0] is not groups[1]

    reads = stack.run_step()

    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == []
    assert len(reads) == 8 and len(stack.op_buffers) == 4
    assert foreign_event_waits() == []
    assert all(g.leader_writes_follow_impl for g in groups)
    extra = model.layers[0].self_attn.attn.impl.index_group.ubatch_logical_topk
    ubatch1 = ubatch1_logical(extra)
    assert sorted(address(b) == ubatch1 for b in stack.op_buffers) == [False, False, True, True]
    cleared = [address(b) == ubatch1 for b in stack.cleared]
    assert cleared == ([False, True] * 2 if fused else [])
    check_wired(model, 2)
    assert "2 microbatches, 1 index groups with followers, 132 bytes" in describe(model)


def test_mistral_without_dbo_allocates_nothing(fake_gpu, monkeypatch):
    from vllm_dsa_dbo.diagnostics.refusals import check_wired
    from vllm_dsa_dbo.diagnostics.startup import describe

    model = build_model(monkeypatch, fake_gpu, enable_dbo=False)
    groups = [layer.self_attn.attn.impl.index_group for layer in model.layers]
    assert all(not g.ubatch_logical_topk.followed and not g.ubatch_topk_states for g in groups)
    check_wired(model)
    assert describe(model) is None


def test_mistral_leader_with_an_unwired_writer_is_refused(fake_gpu, monkeypatch):
    """A leader whose indexer op is vLLM's own (it would write microbatch 0's buffer): its
    group is left unwired, the step reads as stock vLLM does, and the loader refuses it."""
    from vllm.model_executor.layers import sparse_attn_indexer
    from vllm.models.mistral.nvidia import indexer

    monkeypatch.setattr(indexer, "SparseAttnIndexer", sparse_attn_indexer.SparseAttnIndexer)
    model = build_model(monkeypatch, fake_gpu, enable_dbo=True)
    reads = MistralStack(model, monkeypatch).run_step()
    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == [(2, 0), (3, 0)]
    assert not any(
        layer.self_attn.attn.impl.index_group.leader_writes_follow_impl for layer in model.layers
    )
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        build_model(monkeypatch, fake_gpu, enable_dbo=True, loaded=True)


@pytest.mark.parametrize(
    "index_sharing",
    [["full", "FULL", "full", "full"], ["full", "Shared", "Shared", "full"]],
    ids=["FULL", "Shared"],
)
def test_mistral_odd_index_sharing_is_fixed_and_refused_with_the_fix_off(
    fake_gpu, monkeypatch, index_sharing
):
    """vLLM's layer specs make every value other than exactly "full" a follower, and an HF
    config.json is not validated: the fix keeps those followers' top-k per microbatch, and the
    guard, which is all that runs with the fix off, refuses them under DBO."""
    from vllm_dsa_dbo import guard
    from vllm_dsa_dbo.diagnostics.refusals import check_wired

    model = build_model(monkeypatch, fake_gpu, enable_dbo=True, index_sharing=index_sharing)
    leaders = [s.has_indexer for s in model.layer_specs]
    assert leaders == [kind == "full" for kind in index_sharing]
    reads = MistralStack(model, monkeypatch, leaders).run_step()
    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == []
    check_wired(model, 2)
    hf = model.config
    config = SimpleNamespace(
        model_config=SimpleNamespace(architecture=hf.architectures[0], hf_config=hf),
        parallel_config=SimpleNamespace(enable_dbo=True),
    )
    with pytest.raises(ValueError, match="index_sharing with a layer other than 'full'"):
        guard.refuse_unfixed(config, "why.")


UNFIXED = {
    # vLLM's ROCm model: its own MistralMLAAttention and MistralIndexer, which nothing wires.
    "rocm": ("amd", "ROCM_AITER_MLA_SPARSE", "Mistral Large 4 on CUDA, vllm/models/mistral/nvidia"),
    # The CUDA model on a backend whose impl joins no index group.
    "xpu backend": ("nvidia", "XPU_MLA_SPARSE", "keeps no index groups"),
}


@pytest.mark.parametrize("path", UNFIXED)
def test_mistral_paths_left_unfixed_are_refused_at_load(fake_gpu, monkeypatch, path):
    """Built by the loader's initialize_model, as a worker builds it: refused under DBO, with
    a message saying what is covered or why, and built without DBO."""
    platform, backend, reason = UNFIXED[path]
    model = build_model(
        monkeypatch, fake_gpu, enable_dbo=False, platform=platform, backend=backend, loaded=True
    )
    assert [layer.self_attn.indexer is not None for layer in model.layers] == LEADERS
    with pytest.raises(ValueError, match=f"{reason}.*Drop --enable-dbo"):
        build_model(
            monkeypatch, fake_gpu, enable_dbo=True, platform=platform, backend=backend, loaded=True
        )


@pytest.mark.parametrize(
    "sharing, index_sharing",
    [("full,full,shared,shared", ["full", "full", "shared", "shared"]), ("full", ["full"] * 4)],
)
def test_guard_refuses_mistral_index_sharing_under_dbo(sharing, index_sharing):
    """vLLM's adapter turns params.json's `dsa.sharing` into a per-layer `index_sharing` list;
    the guard (other versions, the fix off) refuses it under DBO when a layer is "shared"."""
    from vllm_dsa_dbo import guard

    hf = hf_config(sharing)
    assert hf.architectures == ["MistralLarge4ForCausalLM"]
    assert hf.index_sharing == index_sharing
    model_config = SimpleNamespace(architecture=hf.architectures[0], hf_config=hf)
    config = SimpleNamespace(
        model_config=model_config, parallel_config=SimpleNamespace(enable_dbo=True)
    )
    if "shared" in index_sharing:
        with pytest.raises(
            ValueError, match="index_sharing with a layer other than .full.*Drop --enable-dbo"
        ):
            guard.refuse_unfixed(config, "why.")
    else:
        guard.refuse_unfixed(config, "why.")
    config.parallel_config.enable_dbo = False
    guard.refuse_unfixed(config, "why.")
