"""vLLM 0.33.0's in-tree change, as data (`vllm_dsa_dbo.upstream` reads it), written
by `python -m vllm_dsa_dbo.upstream.regenerate` from a patched tree: regenerate, do not edit."""

VERSION = "0.33.0"
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
            "b9a419019eb1a63417d3131329543a4f3cbd99905b0486fa3d5b0aaaaf52550d",
            "d5f5acb379b8e7b957663d9c9a65f8bb81cda3c0b6fc8697ddca8dcca477dc5b",
            """\
@@ 6 6
from vllm.v1.worker.ubatching import dbo_current_ubatch_id
""",
        ),
        "_create_event": (
            "f417f34fedb2cc461e27e1b64a0897a3f724b23b24dfed35e0a66d261d56eeda",
            "f417f34fedb2cc461e27e1b64a0897a3f724b23b24dfed35e0a66d261d56eeda",
            '''\
@@ 2 2


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
            "489cd377adf328fece9b579b7e897f3ad68b596581b6ab47915886458c1fd1c3",
            "e04778dc9d7681e97d6af776353322c241623e574452a00447fc5561ebf3ec94",
            '''\
@@ 12 12
    # Indexed by DBO microbatch id, in groups with followers only: the other
    # microbatch may run its leader before this one's followers read. The empty
    # defaults are class attributes: groups built without __init__ read them.
    ubatch_topk: Sequence[SparseMLATopkState] = ()
    # The builder's logical top-k per DBO microbatch, shared by its groups.
    ubatch_logical_topk: Sequence[torch.Tensor] = ()

    def _topk_state(self) -> SparseMLAIndexGroup | SparseMLATopkState:
        if not self.ubatch_topk:
            return self
        return self.ubatch_topk[dbo_current_ubatch_id()]

    def ubatch_logical_topk_indices(self, buffer: torch.Tensor) -> torch.Tensor:
        """The calling DBO microbatch's copy of the builder's logical buffer."""
        if not self.ubatch_logical_topk or buffer is not self.ubatch_logical_topk[0]:
            return buffer
        return self.ubatch_logical_topk[dbo_current_ubatch_id()]
@@ 34 35
        self._topk_state().logical_topk_ready.record(current_stream())
@@ 104 106
        state = self._topk_state()
        physical_topk_indices = state.physical_topk_indices[:num_tokens]
        valid_topk_counts = state.valid_topk_counts[:num_tokens]
@@ 109 110
                self.side_stream.wait_event(state.logical_topk_ready)
@@ 127 129
                state.physical_topk_ready.record(self.side_stream)
        compute_stream.wait_event(state.physical_topk_ready)
''',
        ),
        "SparseMLAIndexGroupBuilder": (
            "1aa8dcfbd96630ac7ce5c494881c7b7aa35bf2e5534978a79fc7e4c72d271b9f",
            "89610d11bfb91b78588719a4c0e21a9430ee028324c673577c21efd046896d07",
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
                    _create_event(),
                    _create_event(),
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
            "d3f26c9a34c0b99de811510f178bdc46d16bdc6d47fd3e06d134761fcaece4d8",
            "bea0bf43915c18cb52be1e5c9a1318d1701b0756798aa82e8f28b83553581f9f",
            """\
@@ 272 273
            self.impl.topk_indices_buffer,  # type: ignore[attr-defined]
@@ 380 381
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
            "2ae590ca7156d062ee7cf5f50cb95fa1f585cab628569f50c54fa5577f1d5216",
            "93ba9e0a4812914a72f8354deb431d0dc5ccdc382ffeb4bd29366fb041337443",
            """\
@@ 32 32
            get_num_ubatches(vllm_config.parallel_config),
""",
        ),
    },
    "tests/v1/attention/test_sparse_mla_backends.py": {
        "test_sparse_mla_index_groups_own_distinct_physical_buffers": (
            "4c5b13f4bf71704608c5fb36b1aaad635a2f66d4c436743acb451f20ef14f827",
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
}
