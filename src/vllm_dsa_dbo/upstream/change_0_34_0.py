"""vLLM 0.34.0's in-tree change, as data (`vllm_dsa_dbo.upstream` reads it), written
by `python -m vllm_dsa_dbo.upstream.regenerate` from a patched tree: regenerate, do not edit."""

VERSION = "0.34.0"
CHANGE = {
    "vllm/v1/attention/backends/mla/index_group.py": {
        "from dataclasses import": (
            "10c0ced64ad2be8b72de55102169bfe7aace78d2e7f655f7c645f0c10f8865ad",
            "10c0ced64ad2be8b72de55102169bfe7aace78d2e7f655f7c645f0c10f8865ad",
            """\
@@ 0 0
from collections.abc import Sequence
""",
        ),
        "from vllm.v1.hisparse.runtime import": (
            "42cbc317b27bf4b7d65831dc1966ec088c12d7467703209df2ff1a80b847fe48",
            "425843f38e59e8a8db939483351ea9d6aa05771fbe0b7ddf92b912322eb2feb3",
            '''\
@@ 5 5
from vllm.v1.worker.ubatching import dbo_current_ubatch_id


@dataclass
class SparseMLATopkState:
    """One DBO microbatch's converted top-k and the events that order it."""

    physical_topk_indices: torch.Tensor
    valid_topk_counts: torch.Tensor
    logical_topk_ready: torch.Event
    physical_topk_ready: torch.Event
''',
        ),
        "SparseMLAIndexGroup": (
            "30109d758abbfc1d63c449cd72032c9c3647637f9cb48973085d09c3e4a2bfb6",
            "e361694d12252551160a8bcc33358d6650e8e933b48cba9f53f7773e80c1a92c",
            '''\
@@ 12 12
    # Indexed by DBO microbatch id, in groups with followers only: the other
    # microbatch may run its leader before this one's followers read. The empty
    # defaults are class attributes: groups built without __init__ read them.
    ubatch_topk: Sequence[SparseMLATopkState] = ()
    # The builder's logical top-k per DBO microbatch, shared by its groups.
    ubatch_logical_topk: Sequence[torch.Tensor] = ()
@@ 15 15

    def _topk_state(self) -> SparseMLAIndexGroup | SparseMLATopkState:
        if not self.ubatch_topk:
            return self
        return self.ubatch_topk[dbo_current_ubatch_id()]

    def ubatch_logical_topk_indices(self, buffer: torch.Tensor) -> torch.Tensor:
        """The calling DBO microbatch's copy of the builder's logical buffer."""
        if not self.ubatch_logical_topk or buffer is not self.ubatch_logical_topk[0]:
            return buffer
        return self.ubatch_logical_topk[dbo_current_ubatch_id()]
@@ 37 38
        self._topk_state().logical_topk_ready.record(self._current_stream())
@@ 107 109
        state = self._topk_state()
        physical_topk_indices = state.physical_topk_indices[:num_tokens]
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
            "f90b4b8c354e2363654e358ce9df6794d9ffdb192c31e53e31a9161fba837ac8",
            '''\
@@ 4 5
        self,
        logical_topk_indices: torch.Tensor,
        max_decode_rows: int | None = None,
        num_ubatches: int = 1,
@@ 12 12
        self.num_ubatches = num_ubatches
        self.ubatch_logical_topk: list[torch.Tensor] = []
@@ 47 47
                ubatch_logical_topk=self.ubatch_logical_topk,
@@ 54 54
        if group_index == 1 and self.num_ubatches > 1:
            self._add_ubatch_topk(group)
@@ 55 55

    def _add_ubatch_topk(self, group: SparseMLAIndexGroup) -> None:
        """Under DBO the other microbatch's leader may run before a follower."""
        logical = self.logical_topk_indices
        if not self.ubatch_logical_topk:
            self.ubatch_logical_topk.append(logical)
            for _ in range(1, self.num_ubatches):
                self.ubatch_logical_topk.append(torch.empty_like(logical))
        group.ubatch_topk = [
            SparseMLATopkState(
                group.physical_topk_indices,
                group.valid_topk_counts,
                group.logical_topk_ready,
                group.physical_topk_ready,
            ),
            *(
                SparseMLATopkState(
                    torch.empty_like(group.physical_topk_indices),
                    torch.empty_like(group.valid_topk_counts),
                    torch.Event(),
                    torch.Event(),
                )
                for _ in range(1, self.num_ubatches)
            ),
        ]
''',
        ),
    },
    "vllm/model_executor/layers/attention/sparse_mla_attention.py": {
        "SharedTopkIndicesBuffer": (
            "d33ee6ce2b3532a0b84aec8823b5afa8ba0c342e75810874429131b7311275cb",
            "9bf39cde1a22d8d0892c09fad05fa56007c9544f8882d2c85f61cafc514c88e7",
            """\
@@ 11 11
    index_group: SparseMLAIndexGroup | None = None
@@ 23 25
            buffer = self._indexer.topk_indices_buffer  # type: ignore[attr-defined]
        else:
            buffer = self._topk_indices_buffer
        group = self.index_group
        if group is None or not group.ubatch_logical_topk or buffer is None:
            return buffer
        return group.ubatch_logical_topk_indices(buffer)
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
            "d83ab716f61ad9254c2e52b51f0072960faa6759de17cbb2d3b0e677d1b136bb",
            '''\
@@ 2 3
    into the buffer its caller passes: the model-wide `topk_indices_buffer`, or
    under DBO the calling microbatch's copy of it."""
@@ 94 94
        topk_indices_buffer: torch.Tensor,
@@ 95 95
        # The op writes the buffer it holds: this call's, a DBO microbatch's own.
        self.indexer_op.topk_indices_buffer = topk_indices_buffer
@@ 169 170
                topk_indices=topk_indices_buffer if self.fuse_k_cache else None,
''',
        ),
    },
    "tests/v1/attention/test_sparse_mla_backends.py": {
        "test_sparse_mla_index_groups_own_distinct_physical_buffers": (
            "a50e9084f5dece2a958cdd94bb8da7e505db7aa9856487028e5f821367008f2e",
            "a50e9084f5dece2a958cdd94bb8da7e505db7aa9856487028e5f821367008f2e",
            '''\
@@ 15 15


def test_sparse_mla_index_group_keeps_topk_per_dbo_ubatch(monkeypatch):
    """Under DBO both microbatches run a leader before either runs its
    follower; each follower must still read its own leader's top-k."""
    device = torch.device(DEVICE_TYPE)
    logical = torch.full((2, 128), -1, dtype=torch.int32, device=device)
    builder = SparseMLAIndexGroupBuilder(logical, num_ubatches=2)
    alone, _ = builder.register_layer(True)
    group, leader_index = builder.register_layer(True)
    _, follower_index = builder.register_layer(False)
    assert not alone.ubatch_topk

    leader, follower = SharedTopkIndicesBuffer(), SharedTopkIndicesBuffer()
    leader.init_topk_indices_buffer(SimpleNamespace(topk_indices_buffer=logical), None)
    follower.init_topk_indices_buffer(None, logical)
    leader.index_group = follower.index_group = group
    metadata = SimpleNamespace(
        block_table=torch.tensor([[2, 3], [4, 5]], dtype=torch.int32, device=device),
        block_size=4,
        req_id_per_token=torch.tensor([0, 1], dtype=torch.int32, device=device),
    )

    def read(layer_index: int, impl: SharedTopkIndicesBuffer) -> list[torch.Tensor]:
        topk = impl.topk_indices_buffer
        assert topk is not None
        physical = group.convert_logical_to_physical_topk(
            layer_index,
            topk,
            metadata,
            block_stride_rows=None,
            return_valid_counts=True,
        )
        return [t.clone() for t in (topk, *physical)]

    ubatch_id = 0
    monkeypatch.setattr(index_group_module, "dbo_current_ubatch_id", lambda: ubatch_id)
    written = []
    for ubatch_id in range(2):
        topk = leader.topk_indices_buffer
        assert topk is not None
        topk[:, :3] = torch.tensor([[0, 2, 5], [1, 3, 7]], device=device) - ubatch_id
        group.set_logical_topk_ready(leader_index)
        written.append(read(leader_index, leader))
    for ubatch_id in range(2):
        for ours, theirs in zip(read(follower_index, follower), written[ubatch_id]):
            assert torch.equal(ours, theirs)
''',
        ),
    },
    "tests/models/mistral/test_ml4_index_sharing.py": {
        "": (
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            "e4b7bafabf6dd0b062f1d6033db3c5e603ac3bd99f1a05dd40a1be1954bab926",
            '''\
@@ 0 0
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mistral Large 4 index sharing under DBO: a leader's indexer writes the
logical top-k its "shared" followers read, one copy per microbatch."""

from types import SimpleNamespace

import torch
from torch import nn

from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SharedTopkIndicesBuffer,
)
from vllm.models.mistral.nvidia.attention import MistralMLAAttention
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mla import index_group as index_group_module
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

DEVICE_TYPE = current_platform.device_type
NUM_TOKENS = 2


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
    """Writes the top-k it is set to into the buffer it is handed."""

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
        topk_indices_buffer: torch.Tensor,
    ) -> torch.Tensor:
        topk_indices_buffer[:NUM_TOKENS, :3] = self.topk
        return topk_indices_buffer


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
    logical = torch.full((NUM_TOKENS, 128), -1, dtype=torch.int32, device=device)
    builder = SparseMLAIndexGroupBuilder(logical, num_ubatches=2)
    indexer = _Indexer(logical)
    leader = _leader(_Impl(builder, indexer, logical), indexer)
    follower = _Impl(builder, None, logical)

    ubatch_id = 0
    monkeypatch.setattr(index_group_module, "dbo_current_ubatch_id", lambda: ubatch_id)
    written = []
    for ubatch_id in range(2):
        indexer.topk = torch.tensor([[0, 2, 5], [1, 3, 7]], device=device) - ubatch_id
        hidden_states = torch.zeros(NUM_TOKENS, 1, device=device)
        leader(torch.arange(NUM_TOKENS), hidden_states, hidden_states, None)
        written.append(indexer.topk)
    for ubatch_id in range(2):
        topk = follower.topk_indices_buffer
        assert topk is not None
        assert torch.equal(topk[:NUM_TOKENS, :3], written[ubatch_id])
''',
        ),
    },
}
