"""vLLM 0.34.0's in-tree change, as data (`vllm_dsa_dbo.upstream` reads it), written
by `python -m vllm_dsa_dbo.upstream.regenerate` from a patched tree: regenerate, do not edit."""

VERSION = "0.34.0"
CHANGE = {
    "vllm/v1/attention/backends/mla/index_group.py": {
        "from vllm.v1.hisparse.runtime import": (
            "42cbc317b27bf4b7d65831dc1966ec088c12d7467703209df2ff1a80b847fe48",
            "425843f38e59e8a8db939483351ea9d6aa05771fbe0b7ddf92b912322eb2feb3",
            '''\
@@ 5 5
from vllm.v1.worker.ubatching import (
    dbo_current_ubatch_id,
    dbo_current_ubatch_token_offset,
)


@dataclass
class SparseMLAUbatchTopk:
    """One DBO microbatch's valid counts and the events that order its top-k."""

    valid_topk_counts: torch.Tensor
    logical_topk_ready: torch.Event
    physical_topk_ready: torch.Event
''',
        ),
        "SparseMLAIndexGroup": (
            "30109d758abbfc1d63c449cd72032c9c3647637f9cb48973085d09c3e4a2bfb6",
            "c68c1c9f80ec3ea09735fbf411fcc37e79414f9328c46758b0c0c3a00d5908d8",
            '''\
@@ 12 12
    # By DBO microbatch id, in groups with followers only: the other microbatch
    # may run its leader before this one's followers read.
    ubatch_topk: tuple[SparseMLAUbatchTopk, ...] = ()
@@ 15 15

    def _topk_state(self) -> SparseMLAIndexGroup | SparseMLAUbatchTopk:
        if not self.ubatch_topk:
            return self
        return self.ubatch_topk[dbo_current_ubatch_id()]

    def ubatch_topk_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (top-k, logical or physical) from the calling DBO microbatch's
        first token in the whole batch."""
        if not self.ubatch_topk:
            return rows
        # The indexer's padded decode path fills rows[:num_padded_tokens], so a
        # microbatch's padding can land in the next microbatch's rows. DBO's
        # yields keep that safe: microbatch k runs its next leader only after
        # microbatch k + 1's followers of the previous leader have read.
        return rows[dbo_current_ubatch_token_offset() :]
@@ 37 38
        self._topk_state().logical_topk_ready.record(self._current_stream())
@@ 95 96
        physical_topk_indices = self.ubatch_topk_rows(self.physical_topk_indices)
        if num_tokens > physical_topk_indices.shape[0]:
@@ 107 109
        state = self._topk_state()
        physical_topk_indices = physical_topk_indices[:num_tokens]
        valid_topk_counts = state.valid_topk_counts[:num_tokens]
@@ 112 113
                self.side_stream.wait_event(state.logical_topk_ready)
@@ 130 132
                state.physical_topk_ready.record(self.side_stream)
        compute_stream.wait_event(state.physical_topk_ready)
''',
        ),
        "SparseMLAIndexGroupBuilder": (
            "e2e40be23b941133709cabd2c70ffaa115e74d5c113e385b1ac0fe7bca36438e",
            "d45fa114a45424d1674c19cb902046d117b92d64b8f34b1c08addf35fbb22caf",
            '''\
@@ 4 5
        self,
        logical_topk_indices: torch.Tensor,
        max_decode_rows: int | None = None,
        num_ubatches: int = 1,
@@ 12 12
        self.num_ubatches = num_ubatches
@@ 54 54
        if group_index == 1 and self.num_ubatches > 1:
            self._add_ubatch_topk(group)
@@ 55 55

    def _add_ubatch_topk(self, group: SparseMLAIndexGroup) -> None:
        """Under DBO the other microbatch's leader may run before a follower."""
        if isinstance(group, HiSparseMLAIndexGroup):
            raise ValueError(
                "HiSparse does not support dual batch overlap on a model with shared "
                "top-k layers (index_topk_freq > 1 or an index_topk_pattern): its "
                "top-k staging has no microbatch dimension. Disable --enable-dbo or "
                "HiSparse (attention_config.hisparse_config)."
            )
        group.ubatch_topk = (
            SparseMLAUbatchTopk(
                group.valid_topk_counts,
                group.logical_topk_ready,
                group.physical_topk_ready,
            ),
            *(
                SparseMLAUbatchTopk(
                    torch.empty_like(group.valid_topk_counts),
                    torch.Event(),
                    torch.Event(),
                )
                for _ in range(1, self.num_ubatches)
            ),
        )
''',
        ),
    },
    "vllm/model_executor/layers/attention/sparse_mla_attention.py": {
        "SharedTopkIndicesBuffer": (
            "d33ee6ce2b3532a0b84aec8823b5afa8ba0c342e75810874429131b7311275cb",
            "775938b56cc26494089139716c1d68c95f3ee4c1f194d8229a950ac352d0413b",
            """\
@@ 11 11
    index_group: SparseMLAIndexGroup | None = None
@@ 23 25
            buffer = self._indexer.topk_indices_buffer  # type: ignore[attr-defined]
        else:
            buffer = self._topk_indices_buffer
        if self.index_group is None or buffer is None:
            return buffer
        return self.index_group.ubatch_topk_rows(buffer)
""",
        ),
    },
    "vllm/models/deepseek_v32/attention.py": {
        "DeepseekV32Attention": (
            "2aa48782dee21fecca86866f2384f8961782905191b705d735f7bc90da8b4c17",
            "e3b23d3044bfa32aaee467658d8a861dd26d11548ca2a9978ebe98b9b4bffe9b",
            """\
@@ 261 262
            self.impl.topk_indices_buffer,  # type: ignore[attr-defined]
@@ 368 369
                self.impl.topk_indices_buffer,  # type: ignore[attr-defined]
""",
        ),
    },
    "vllm/models/deepseek_v32/nvidia/model.py": {
        "from vllm.v1.attention.backends.mla.index_group import": (
            "995535f38221dc97bef22bc3e242eabe191cf487cc80ffc4bc2d3d05d0c13785",
            "2c3670277e879559c139f169c02a428b5a5b513658e1d00fa1d6739b33cf7292",
            """\
@@ 4 4
from vllm.v1.worker.ubatch_utils import get_num_ubatches
""",
        ),
        "DeepseekV32Model": (
            "f78d97a9c104defdcb5ae056715e19256264aa1fba0a12cd4dc3a6423b240638",
            "dd75cb28451ed8924317094bbd3f0ab2697a8f05f7f0c33fedf654f2ca28adb3",
            """\
@@ 32 32
            get_num_ubatches(vllm_config.parallel_config),
""",
        ),
    },
    "vllm/models/mistral/mistral_large4/nvidia/model.py": {
        "from vllm.v1.attention.backends.mla.index_group import": (
            "87154de390bca79c03068c697f788d63ed994e973b56a2226afbee9b7d23ac2d",
            "2c3670277e879559c139f169c02a428b5a5b513658e1d00fa1d6739b33cf7292",
            """\
@@ 4 4
from vllm.v1.worker.ubatch_utils import get_num_ubatches
""",
        ),
        "MistralLarge4Model": (
            "007c53d199054ff26e6dadc15c270ed58e3410ed8788406442dd50324ef5c763",
            "404a8bb8b33773ba5c3f59925e4d4c4bd163755d2a1ed726701e83491dcd6025",
            """\
@@ 30 30
                get_num_ubatches(vllm_config.parallel_config),
""",
        ),
    },
    "vllm/models/mistral/nvidia/attention.py": {
        "MistralMLAAttention": (
            "0b3ec8ebc5b16578e60e3b33723ae04e3f62a0bccf8eb7acd9c2cdf3948b705c",
            "90f1fc418fddbaff4cb097c1e25bebeef90622438f75fb1dea28671c23d6e55a",
            """\
@@ 215 215
            # The buffer this layer's followers read, a DBO microbatch's own.
            topk_indices_buffer = self.attn.impl.topk_indices_buffer  # type: ignore[attr-defined]
@@ 223 223
                        topk_indices_buffer,
""",
        ),
    },
    "vllm/models/mistral/nvidia/indexer.py": {
        "MistralIndexer": (
            "69785b716e5c34fd7879721b6bf243fd6a325e4d798959c37e7514fbd8e1060f",
            "959c22ba8301c35c652d311b985edf2df3be1494474ca7223907951fc6ae2096",
            '''\
@@ 2 3
    into the model-wide `topk_indices_buffer`, or the rows its caller passes."""
@@ 94 94
        topk_indices_buffer: torch.Tensor | None = None,
@@ 95 95
        if topk_indices_buffer is None:
            topk_indices_buffer = self.topk_indices_buffer
@@ 169 170
                topk_indices=topk_indices_buffer if self.fuse_k_cache else None,
@@ 171 172
            return self._select_topk(
                topk_indices_buffer, hidden_states, q_fp8, k, weights
            )
@@ 195 195
        return self._select_topk(topk_indices_buffer, hidden_states, q_fp8, k, weights)

    def _select_topk(
        self,
        topk_indices_buffer: torch.Tensor,
        hidden_states: torch.Tensor,
        q_fp8: torch.Tensor,
        k: torch.Tensor | None,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        # The op writes the buffer it holds, so it takes this call's (a DBO
        # microbatch's rows) at its launch: nothing between the two yields to
        # another microbatch.
        self.indexer_op.topk_indices_buffer = topk_indices_buffer
''',
        ),
    },
    "tests/v1/attention/test_sparse_mla_backends.py": {
        "from vllm.platforms import": (
            "4b70859671f6c2badc96708f18618cf151540424702a88c7d1d4199b7a9761f3",
            "4b70859671f6c2badc96708f18618cf151540424702a88c7d1d4199b7a9761f3",
            """\
@@ 0 0
from vllm.models.deepseek_v32 import attention as deepseek_v32_attention
""",
        ),
        "test_sparse_mla_index_groups_own_distinct_physical_buffers": (
            "a50e9084f5dece2a958cdd94bb8da7e505db7aa9856487028e5f821367008f2e",
            "a50e9084f5dece2a958cdd94bb8da7e505db7aa9856487028e5f821367008f2e",
            '''\
@@ 15 15


@pytest.mark.parametrize("max_decode_rows", [4, 2])
def test_sparse_mla_index_group_keeps_topk_per_dbo_ubatch(monkeypatch, max_decode_rows):
    """Under DBO both microbatches run a leader before either runs its
    follower; each follower must still read its own leader's top-k. A
    microbatch whose rows end past the group's converts per layer."""
    device = torch.device(DEVICE_TYPE)
    logical = torch.full((4, 128), -1, dtype=torch.int32, device=device)
    builder = SparseMLAIndexGroupBuilder(logical, max_decode_rows, num_ubatches=2)
    alone, _ = builder.register_layer(True)
    group, leader_index = builder.register_layer(True)
    _, follower_index = builder.register_layer(False)
    assert not alone.ubatch_topk and len(group.ubatch_topk) == 2

    leader, follower = SharedTopkIndicesBuffer(), SharedTopkIndicesBuffer()
    leader.init_topk_indices_buffer(SimpleNamespace(topk_indices_buffer=logical), None)
    follower.init_topk_indices_buffer(None, logical)
    leader.index_group = follower.index_group = group
    metadata = [
        SimpleNamespace(
            block_table=torch.tensor(table, dtype=torch.int32, device=device),
            block_size=4,
            req_id_per_token=torch.tensor([0, 1], dtype=torch.int32, device=device),
        )
        for table in ([[2, 3], [4, 5]], [[6, 7], [8, 9]])
    ]

    def read(layer_index: int, impl: SharedTopkIndicesBuffer) -> list[torch.Tensor]:
        topk = impl.topk_indices_buffer
        assert topk is not None
        physical = group.convert_logical_to_physical_topk(
            layer_index,
            topk[:2],
            metadata[ubatch_id],
            block_stride_rows=None,
            return_valid_counts=True,
        )
        return [t.clone() for t in (topk[:2], *physical)]

    # Microbatch 1 selects fewer tokens: its valid counts differ too.
    selected = ([[0, 2, 5], [1, 3, 7]], [[4, 6, -1], [8, 9, -1]])
    ubatch_id = 0
    monkeypatch.setattr(index_group_module, "dbo_current_ubatch_id", lambda: ubatch_id)
    monkeypatch.setattr(
        index_group_module, "dbo_current_ubatch_token_offset", lambda: 2 * ubatch_id
    )
    written = []
    for ubatch_id in range(2):
        topk = leader.topk_indices_buffer
        assert topk is not None
        topk[:2, :3] = torch.tensor(selected[ubatch_id])
        group.set_logical_topk_ready(leader_index)
        written.append(read(leader_index, leader))
    for ubatch_id in range(2):
        for ours, theirs in zip(read(follower_index, follower), written[ubatch_id]):
            assert torch.equal(ours, theirs)


def test_sparse_mla_index_group_refuses_hisparse_followers_under_dbo(monkeypatch):
    """HiSparse stages one top-k per group: under DBO a follower would read
    the other microbatch's selection."""
    monkeypatch.setattr(
        index_group_module,
        "create_hisparse_cache_handle",
        MagicMock(side_effect=lambda *args, **kwargs: SimpleNamespace()),
    )
    config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=object()), model_config=None
    )
    logical = torch.empty((2, 4), dtype=torch.int32)
    kwargs = {"row_width": 656, "kv_cache_dtype": "fp8_ds_mla"}
    builder = SparseMLAIndexGroupBuilder(logical, num_ubatches=2)
    builder.register_layer(True, config, **kwargs)
    with pytest.raises(ValueError, match="HiSparse does not support dual batch"):
        builder.register_layer(False, config, **kwargs)
    alone = SparseMLAIndexGroupBuilder(logical)
    alone.register_layer(True, config, **kwargs)
    assert alone.register_layer(False, config, **kwargs)[1] == 1


def test_deepseek_v32_leader_writes_the_topk_its_followers_read(monkeypatch):
    """Under DBO both microbatches run a leader's forward before either runs
    its follower; both of the leader's writers must write the rows that
    follower reads."""
    device = torch.device(DEVICE_TYPE)
    num_tokens = 2
    logical = torch.full((2 * num_tokens, 128), -1, dtype=torch.int32, device=device)
    builder = SparseMLAIndexGroupBuilder(logical, num_ubatches=2)
    group, leader_index = builder.register_layer(True)
    _, follower_index = builder.register_layer(False)

    class LeaderImpl(SharedTopkIndicesBuffer):
        def prepare_for_batch(self, attn_metadata: object) -> None:
            pass

        def record_logical_topk_ready(self) -> None:
            group.set_logical_topk_ready(leader_index)

    impl, follower = LeaderImpl(), SharedTopkIndicesBuffer()
    impl.init_topk_indices_buffer(None, logical)
    follower.init_topk_indices_buffer(None, logical)
    impl.index_group = follower.index_group = group

    def fused_norm_rope(*args, **kwargs):
        # Clears the leader's top-k rows, as the fused kernel does.
        args[14][:num_tokens] = -1
        return args[1]

    def sparse_attn_indexer(*args, **kwargs):
        args[13][:num_tokens, :3] = selected

    attention = deepseek_v32_attention
    context = SimpleNamespace(
        slot_mapping={}, attn_metadata=None, cudagraph_runtime_mode=None
    )
    monkeypatch.setattr(attention, "get_forward_context", lambda: context)
    monkeypatch.setattr(attention, "get_attention_context", lambda name: (None,) * 4)
    monkeypatch.setattr(attention, "fused_norm_rope", fused_norm_rope)
    monkeypatch.setattr(attention, "sparse_attn_indexer", sparse_attn_indexer)
    monkeypatch.setattr(
        attention, "fused_q", lambda *args, **kwargs: (torch.zeros(num_tokens),) * 3
    )
    # The projections as stand-ins, one head of one dimension each.
    layer = MagicMock(
        impl=impl,
        topk_indices_buffer=logical,
        hisparse_cache=None,
        skip_topk=False,
        use_pcp=False,
        q_lora_rank=1,
        kv_lora_rank=1,
        qk_rope_head_dim=1,
        qk_nope_head_dim=1,
        qk_head_dim=2,
        num_local_heads=1,
        v_head_dim=1,
        fused_qkv_a_proj=lambda x: (torch.zeros(num_tokens, 3),),
        q_b_proj=lambda x: (torch.zeros(num_tokens, 2),),
    )
    layer.indexer.head_dim = layer.indexer.n_head = 1
    layer.indexer.wk_weights_proj = lambda x: (torch.zeros(num_tokens, 2),)
    layer.indexer.wq_b = lambda x: (torch.zeros(num_tokens, 1),)
    layer._should_prepare_mqa_query.return_value = False
    layer._sparse_indexer_and_attn = MethodType(
        attention.DeepseekV32Attention._sparse_indexer_and_attn, layer
    )

    ubatch_id = 0
    monkeypatch.setattr(index_group_module, "dbo_current_ubatch_id", lambda: ubatch_id)
    monkeypatch.setattr(
        index_group_module,
        "dbo_current_ubatch_token_offset",
        lambda: num_tokens * ubatch_id,
    )
    written = []
    for ubatch_id in range(2):
        selected = torch.tensor([[0, 2, 5], [1, 3, 7]], device=device) + ubatch_id
        hidden_states = torch.zeros(num_tokens, 1)
        attention.DeepseekV32Attention.forward(
            layer, torch.arange(num_tokens), hidden_states
        )
        written.append(selected)
    for ubatch_id in range(2):
        topk = follower.topk_indices_buffer
        assert topk is not None
        assert torch.equal(topk[:num_tokens, :3], written[ubatch_id])
''',
        ),
    },
    "tests/models/mistral/test_ml4_index_sharing.py": {
        "": (
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "4c98889e10c95704d1e2a5cf149408b1cdf2fdcbd0ed517033f34bf4988b69e9",
            '''\
@@ 0 0
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mistral Large 4 index sharing under DBO: a leader's indexer writes the
logical top-k its "shared" followers read, in the calling microbatch's rows."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SharedTopkIndicesBuffer,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mla import index_group as index_group_module
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

if current_platform.is_rocm():
    pytest.skip(
        "ROCm runs its own Mistral indexer (models/mistral/amd)",
        allow_module_level=True,
    )

from vllm.models.mistral.nvidia import indexer as indexer_module  # noqa: E402
from vllm.models.mistral.nvidia.attention import MistralMLAAttention  # noqa: E402
from vllm.models.mistral.nvidia.indexer import MistralIndexer  # noqa: E402

DEVICE_TYPE = current_platform.device_type
NUM_TOKENS = 2
# Each microbatch's top-k, microbatch 1's with fewer tokens selected.
SELECTED = ([[0, 2, 5], [1, 3, 7]], [[4, 6, -1], [8, 9, -1]])


class _Impl(SharedTopkIndicesBuffer):
    """A sparse MLA impl's share of the top-k: its buffer and index group."""

    def __init__(
        self,
        builder: SparseMLAIndexGroupBuilder,
        indexer: nn.Module | None,
        topk_indices_buffer: torch.Tensor,
    ) -> None:
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)
        self.index_group, self.index_group_index = builder.register_layer(
            indexer is not None
        )

    def record_logical_topk_ready(self) -> None:
        assert self.index_group is not None
        self.index_group.set_logical_topk_ready(self.index_group_index)


class _Indexer(nn.Module):
    """Writes the top-k it is set to into the rows it is handed."""

    def __init__(self, topk_indices_buffer: torch.Tensor) -> None:
        super().__init__()
        self.topk_indices_buffer = topk_indices_buffer
        self.topk = torch.empty(0)

    def project_k(self, hidden_states: torch.Tensor) -> None:
        pass

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        log_positions: torch.Tensor,
        rotary_emb: object,
        topk_indices_buffer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if topk_indices_buffer is None:
            topk_indices_buffer = self.topk_indices_buffer
        topk_indices_buffer[:NUM_TOKENS, :3] = self.topk
        return topk_indices_buffer


class _IndexerOp:
    """Writes the top-k it is set to into the buffer it holds at its call."""

    def __init__(self, topk_indices_buffer: torch.Tensor) -> None:
        self.topk_indices_buffer = topk_indices_buffer
        self.topk = torch.empty(0)

    def __call__(self, *args: object) -> torch.Tensor:
        self.topk_indices_buffer[:NUM_TOKENS, :3] = self.topk
        return self.topk_indices_buffer


class _Attention(nn.Module):
    def __init__(self, impl: _Impl) -> None:
        super().__init__()
        self.impl = impl

    def prepare_mqa_query(self, *args: object) -> None:
        return None

    def forward(self, *args: object, output_shape: tuple[int, int], **kwargs):
        return torch.zeros(output_shape)


def _leader(impl: _Impl, indexer: _Indexer) -> MistralMLAAttention:
    """A leader layer's MistralMLAAttention around `indexer` and `impl`."""
    layer = MistralMLAAttention.__new__(MistralMLAAttention)
    nn.Module.__init__(layer)
    layer.spec = SimpleNamespace(use_sparse=True, indexer_use_rope=False)
    layer.num_local_heads, layer.v_head_dim = 1, 1
    layer.indexer = indexer
    layer.indexer_stream = None
    layer.indexer_events = [None, None]
    layer.attn = _Attention(impl)
    layer.o_proj = lambda out: (out,)
    qkv = (torch.zeros(NUM_TOKENS, 1, 1),) * 3
    layer._project_qkv = lambda *args: qkv
    return layer


def test_ml4_leader_writes_the_topk_its_followers_read_per_dbo_ubatch(monkeypatch):
    """Under DBO both microbatches run a leader before either runs its
    "shared" follower; each follower must still read its own leader's top-k."""
    device = torch.device(DEVICE_TYPE)
    logical = torch.full((2 * NUM_TOKENS, 128), -1, dtype=torch.int32, device=device)
    builder = SparseMLAIndexGroupBuilder(logical, num_ubatches=2)
    indexer = _Indexer(logical)
    leader = _leader(_Impl(builder, indexer, logical), indexer)
    follower = _Impl(builder, None, logical)

    ubatch_id = 0
    monkeypatch.setattr(index_group_module, "dbo_current_ubatch_id", lambda: ubatch_id)
    monkeypatch.setattr(
        index_group_module,
        "dbo_current_ubatch_token_offset",
        lambda: NUM_TOKENS * ubatch_id,
    )
    for ubatch_id in range(2):
        indexer.topk = torch.tensor(SELECTED[ubatch_id], device=device)
        hidden_states = torch.zeros(NUM_TOKENS, 1, device=device)
        leader(torch.arange(NUM_TOKENS), hidden_states, hidden_states, None)
    for ubatch_id in range(2):
        topk = follower.topk_indices_buffer
        assert topk is not None
        assert topk[:NUM_TOKENS, :3].tolist() == SELECTED[ubatch_id]


def test_ml4_indexer_op_writes_the_rows_its_caller_passes(monkeypatch):
    """The indexer's op writes the rows of the call it runs in: a DBO
    microbatch's, not the model-wide buffer's first."""
    device = torch.device(DEVICE_TYPE)
    logical = torch.full((2 * NUM_TOKENS, 128), -1, dtype=torch.int32, device=device)
    monkeypatch.setattr(
        indexer_module,
        "per_token_group_quant_fp8",
        lambda x, *args, **kwargs: (x, torch.ones(x.shape[0], 1, device=device)),
    )
    # The unfused path without rope, its projections as stand-ins.
    indexer = MistralIndexer.__new__(MistralIndexer)
    nn.Module.__init__(indexer)
    indexer.n_head, indexer.head_dim, indexer.quant_block_size = 1, 1, 1
    indexer.fuse_q = indexer.fuse_k = indexer.fuse_q_norm = False
    indexer.fuse_k_cache, indexer.ssmax, indexer.weights_scale = False, None, 1.0
    indexer.q_input_norm = indexer.k_norm = nn.Identity()
    indexer.wq_b = lambda x: (torch.zeros(NUM_TOKENS, 1, device=device),)
    indexer.kw_ready = SimpleNamespace(wait=lambda: None)
    indexer.topk_indices_buffer = logical
    indexer.indexer_op = _IndexerOp(logical)

    hidden_states = torch.zeros(NUM_TOKENS, 1, device=device)
    positions = torch.arange(NUM_TOKENS, device=device)
    for ubatch_id in range(2):
        indexer.indexer_op.topk = torch.tensor(SELECTED[ubatch_id], device=device)
        indexer.kw = torch.zeros(NUM_TOKENS, 2, device=device)
        rows = logical[NUM_TOKENS * ubatch_id :]
        indexer(hidden_states, positions, positions, None, rows)
    assert logical[:, :3].tolist() == [*SELECTED[0], *SELECTED[1]]
''',
        ),
    },
}
