"""vLLM 0.33.0's in-tree change, as data (`vllm_dsa_dbo.upstream` reads it), written
by `python -m vllm_dsa_dbo.upstream.regenerate` from a patched tree: regenerate, do not edit."""

VERSION = "0.33.0"
CHANGE = {
    "vllm/v1/attention/backends/mla/index_group.py": {
        "from vllm.v1.hisparse.runtime import": (
            "b9a419019eb1a63417d3131329543a4f3cbd99905b0486fa3d5b0aaaaf52550d",
            "d5f5acb379b8e7b957663d9c9a65f8bb81cda3c0b6fc8697ddca8dcca477dc5b",
            """\
@@ 6 6
from vllm.v1.worker.ubatching import (
    dbo_current_ubatch_id,
    dbo_current_ubatch_token_offset,
)
""",
        ),
        "_create_event": (
            "f417f34fedb2cc461e27e1b64a0897a3f724b23b24dfed35e0a66d261d56eeda",
            "f417f34fedb2cc461e27e1b64a0897a3f724b23b24dfed35e0a66d261d56eeda",
            '''\
@@ 2 2


@dataclass
class SparseMLAUbatchTopk:
    """One DBO microbatch's valid counts and the events that order its top-k."""

    valid_topk_counts: torch.Tensor
    logical_topk_ready: torch.Event
    physical_topk_ready: torch.Event
''',
        ),
        "SparseMLAIndexGroup": (
            "489cd377adf328fece9b579b7e897f3ad68b596581b6ab47915886458c1fd1c3",
            "dc463cd62d51a0cfcec0aa11590915e8c47a37c5961c822258471d027ae9c163",
            '''\
@@ 12 12
    # By DBO microbatch id, in groups with followers only: the other microbatch
    # may run its leader before this one's followers read.
    ubatch_topk: tuple[SparseMLAUbatchTopk, ...] = ()

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
@@ 34 35
        self._topk_state().logical_topk_ready.record(current_stream())
@@ 92 93
        physical_topk_indices = self.ubatch_topk_rows(self.physical_topk_indices)
        if num_tokens > physical_topk_indices.shape[0]:
@@ 104 106
        state = self._topk_state()
        physical_topk_indices = physical_topk_indices[:num_tokens]
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
            "b6e159a29197d29871142247b45a823d98a908acc4cfd6c4f4d5c6204c54adab",
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
                    _create_event(),
                    _create_event(),
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
        "from vllm.platforms import": (
            "4b70859671f6c2badc96708f18618cf151540424702a88c7d1d4199b7a9761f3",
            "4b70859671f6c2badc96708f18618cf151540424702a88c7d1d4199b7a9761f3",
            """\
@@ 0 0
from vllm.models.deepseek_v32 import attention as deepseek_v32_attention
""",
        ),
        "test_sparse_mla_index_groups_own_distinct_physical_buffers": (
            "4c5b13f4bf71704608c5fb36b1aaad635a2f66d4c436743acb451f20ef14f827",
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
    kwargs = {"head_size": 656, "kv_cache_dtype": "fp8_ds_mla"}
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
}
