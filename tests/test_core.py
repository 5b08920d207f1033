"""Core: shared top-k stays per DBO microbatch through vLLM's real classes.

Layers A and B lead, C follows B (GLM-5.x layers 1, 2, 3): one group without
followers, one with a follower. One DBO step runs A0 B0 | A1 B1 | C0 | C1
(leader 0, leader 1, then followers), yielding after every layer as the MoE
does.
"""

from __future__ import annotations

import pytest
import torch

from ubatch_rows import address
from vllm_dsa_dbo.cpu_dbo import (
    FIRST_MOE_LAYER,
    GLM5_LAYOUT,
    TOKENS_PER_UBATCH,
    FakeStream,
    SharedTopkStack,
    run_dbo_step,
)

LEADERS = [True, True, False]
# Converted rows for the whole step: each microbatch converts once into the group's state.
WHOLE_STEP = sum(TOKENS_PER_UBATCH)


def foreign_event_waits() -> list[tuple[int, int | None]]:
    """Ready-event waits on an event another microbatch recorded last."""
    return [
        (waiter, recorder)
        for waiter, _, recorder in FakeStream.waits
        if recorder is not None and recorder != waiter
    ]


def test_dbo_ubatch_followers_read_their_own_leaders_topk(fake_gpu):
    stack = SharedTopkStack(LEADERS, num_ubatches=2, max_decode_rows=WHOLE_STEP)
    group_a, group_b, group_c = (impl.index_group for impl in stack.impls)
    assert group_c is group_b and stack.impls[2].index_group_index == 1

    assert group_a.ubatch_topk_states == ()
    assert len(group_b.ubatch_topk_states) == 1
    assert stack.builder.ubatch_logical_topk.followed
    assert group_a.ubatch_logical_topk is stack.builder.ubatch_logical_topk
    assert group_b.ubatch_logical_topk is stack.builder.ubatch_logical_topk

    reads = stack.run_step()

    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == []
    assert len(reads) == 6
    assert foreign_event_waits() == []


def test_dbo_ubatch_writers_and_readers_resolve_one_buffer(fake_gpu):
    stack = SharedTopkStack(LEADERS, num_ubatches=2, max_decode_rows=WHOLE_STEP)
    group = stack.impls[1].index_group
    seen = {}

    def step(ubatch: int) -> None:
        buffers = [stack.attns[1].topk_indices_buffer]
        buffers += [impl.topk_indices_buffer for impl in stack.impls]
        seen[ubatch] = {address(b) for b in buffers}, address(group.physical_topk_indices)

    run_dbo_step(step)
    assert seen[0] == ({address(stack.buffer)}, address(group.physical_topk_indices))
    rows = [t[TOKENS_PER_UBATCH[0] :] for t in (stack.buffer, group.physical_topk_indices)]
    assert seen[1] == ({address(rows[0])}, address(rows[1]))


def test_dbo_ubatch_allocates_no_topk_buffer(fake_gpu):
    """Microbatch 1's logical and converted rows are microbatch 0's, from its token offset:
    only its valid counts (kilobytes) and events are its own."""
    from vllm_dsa_dbo.diagnostics.startup import ubatch_topk_bytes

    stack = SharedTopkStack(LEADERS, num_ubatches=2, max_decode_rows=WHOLE_STEP)
    group = stack.impls[1].index_group
    seen = {}

    def step(ubatch: int) -> None:
        seen[ubatch] = stack.impls[2].topk_indices_buffer, group.physical_topk_indices

    run_dbo_step(step)
    logical, physical = seen[1]
    counts = group.ubatch_topk_states[0].valid_topk_counts
    assert logical._base is stack.buffer and physical._base is group.physical_topk_indices
    assert ubatch_topk_bytes([group]) == counts.numel() * counts.element_size()


@pytest.mark.parametrize("past", [True, False])
def test_dbo_ubatch_past_the_workspace_converts_per_layer(fake_gpu, monkeypatch, past):
    """A microbatch whose rows run past the group's converted rows (at its offset) takes
    vLLM's own per-layer conversion: still its own top-k, converted by every layer; the
    checker counts the step."""
    from vllm.v1.attention.backends.mla import index_group

    from vllm_dsa_dbo.diagnostics import isolation

    conversions = []
    convert = index_group.triton_convert_req_index_to_global_index

    def counted(*args, **kwargs):
        conversions.append("out" in kwargs)
        return convert(*args, **kwargs)

    monkeypatch.setattr(index_group, "triton_convert_req_index_to_global_index", counted)
    checker = isolation.IsolationChecker("audit")
    monkeypatch.setattr(isolation, "CHECKER", checker)
    group_cls = index_group.SparseMLAIndexGroup
    monkeypatch.setattr(group_cls, "_convert_once", group_cls._convert_once)
    [checked] = [p for p in isolation.PATCHES if p.name == "isolation_index_group"]
    checked.apply(index_group)
    rows = sum(TOKENS_PER_UBATCH) - (2 if past else 0)
    reads = SharedTopkStack(LEADERS, num_ubatches=2, max_decode_rows=rows).run_step()

    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == []
    # (into a group's rows, per layer): A converts in each microbatch; B once for B and C,
    # but past its rows from its offset microbatch 1 converts for B and C each.
    into_rows = (3, 2) if past else (4, 0)
    assert (conversions.count(True), conversions.count(False)) == into_rows
    assert (checker.past_workspace_steps, sum(checker.violations.values())) == (int(past), 0)


@pytest.mark.parametrize("padding", [0, TOKENS_PER_UBATCH[1]])
def test_dbo_ubatch_padding_past_its_rows_is_safe_in_dbo_order(fake_gpu, padding):
    """Leaders that fill rows past their own (the indexer's padded decode path) write into
    the next microbatch's rows; in DBO's order that microbatch's followers have read first."""
    from vllm_dsa_dbo.diagnostics.layout import leader_mask

    stack = SharedTopkStack(leader_mask(GLM5_LAYOUT), num_ubatches=2)
    reads = stack.run_step(FIRST_MOE_LAYER, padding=padding)
    assert [(r.layer, r.ubatch) for r in reads if not r.ok] == []


def test_dbo_ubatch_padding_breaks_a_schedule_out_of_dbo_order(fake_gpu):
    """A leader run before the other microbatch's followers of the previous leader have read
    (no yield between them, as dense layers could give) overwrites their rows with padding:
    the layout depends on DBO's order, and this shows it."""
    from vllm_dsa_dbo.diagnostics.layout import leader_mask

    leaders = leader_mask(GLM5_LAYOUT)
    leader = leaders.index(True, FIRST_MOE_LAYER)
    stack = SharedTopkStack(leaders, num_ubatches=2)
    early = {FIRST_MOE_LAYER - 1, leader}
    assert all(r.ok for r in stack.run_step(yield_after=early))
    reads = stack.run_step(yield_after=early, padding=TOKENS_PER_UBATCH[1])
    wrong = [(r.layer, r.ubatch) for r in reads if not r.ok]
    assert wrong == [(layer, 1) for layer in range(FIRST_MOE_LAYER, leader)]


def test_dbo_ubatch_one_microbatch_shows_the_bug(fake_gpu):
    """With one microbatch's state (stock vLLM) the schedule corrupts microbatch 0."""
    reads = SharedTopkStack(LEADERS, num_ubatches=1).run_step()
    wrong = [(r.layer, r.ubatch) for r in reads if not r.ok]
    assert wrong == [(2, 0)]


def test_dbo_ubatch_outside_microbatch_threads_resolves_ubatch0(fake_gpu):
    stack = SharedTopkStack(LEADERS, num_ubatches=2)
    group = stack.impls[1].index_group
    assert stack.impls[2].topk_indices_buffer is stack.buffer
    assert group._topk_state() is group
    assert group.valid_topk_counts is not group.ubatch_topk_states[0].valid_topk_counts


@pytest.mark.parametrize("num_ubatches", [None, 1])
def test_dbo_ubatch_no_dbo_allocates_nothing(fake_gpu, num_ubatches):
    stack = SharedTopkStack(LEADERS, num_ubatches=num_ubatches)
    assert stack.builder.num_ubatches == 1
    assert not stack.builder.ubatch_logical_topk.followed
    assert stack.impls[1].index_group.ubatch_topk_states == ()


def test_dbo_ubatch_leaders_writing_elsewhere_are_refused(fake_gpu):
    """A leader whose module writes the top-k itself (as the deepseek_v2 path on ROCm):
    its group never resolves per microbatch, and the loader refuses the model."""
    import torch.nn as nn

    from vllm_dsa_dbo.cpu_dbo import make_impl
    from vllm_dsa_dbo.diagnostics.refusals import check_wired

    stack = SharedTopkStack(LEADERS, num_ubatches=2)
    leader = make_impl(stack.builder, stack.buffer, leads=True)
    follower = make_impl(stack.builder, stack.buffer, leads=False)
    seen = {}
    run_dbo_step(lambda u: seen.__setitem__(u, follower.topk_indices_buffer))
    assert seen == {0: stack.buffer, 1: stack.buffer}

    modules = []
    for impl in (leader, follower):
        module = nn.Module()
        module.impl = impl
        modules.append(module)
    with pytest.raises(ValueError, match="Drop --enable-dbo"):
        check_wired(nn.ModuleList(modules))
    check_wired(nn.ModuleList([stack.attns[1]]))


@pytest.mark.parametrize("num_ubatches, refused", [(2, True), (1, False)])
def test_dbo_ubatch_followers_in_private_groups_are_refused(fake_gpu, num_ubatches, refused):
    """ROCm DSA / HYV4 style: no shared builder, so a follower gets a group of
    its own and still reads the model-wide logical buffer its leader wrote."""
    import torch.nn as nn
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    from vllm_dsa_dbo.cpu_dbo import attention_module, make_impl
    from vllm_dsa_dbo.diagnostics.refusals import check_wired

    buffer = torch.full((32, 128), -1, dtype=torch.int32)
    impls = [
        make_impl(SparseMLAIndexGroupBuilder(buffer, 8, num_ubatches=num_ubatches), buffer, leads)
        for leads in LEADERS
    ]
    model = nn.ModuleList([attention_module(impl, buffer) for impl in impls])
    assert all(impl.index_group.num_layers == 1 for impl in impls)
    if refused:
        with pytest.raises(ValueError, match="Drop --enable-dbo"):
            check_wired(model)
    else:
        check_wired(model)


def test_dbo_ubatch_other_threads_resolve_ubatch0_while_microbatches_run(fake_gpu):
    """vLLM's own dbo_current_ubatch_id() raises KeyError here; the fix must not."""
    import threading

    stack = SharedTopkStack(LEADERS, num_ubatches=2)
    group = stack.impls[2].index_group
    ubatch0 = group.physical_topk_indices
    seen = []

    def outsider() -> None:
        seen.append((stack.impls[2].topk_indices_buffer, group.physical_topk_indices))

    def step(ubatch: int) -> None:
        if ubatch == 1:
            thread = threading.Thread(target=outsider)
            thread.start()
            thread.join()

    run_dbo_step(step)
    assert seen == [(stack.buffer, ubatch0)]


def test_dbo_ubatch_group_built_without_init_reads_as_stock(fake_gpu, monkeypatch):
    """vLLM's GPU-only tests build groups with `object.__new__` and set only what the code
    under test reads; an unset field raises AttributeError, as a plain one does (`hasattr`,
    `getattr` with a default and a dataclass's repr rely on it)."""
    from vllm.v1.attention.backends.mla import index_group

    from vllm_dsa_dbo.core import UBATCH_TOPK_FIELDS

    def error_reading(group: object, name: str) -> type[Exception] | None:
        try:
            getattr(group, name)
        except Exception as e:
            return type(e)
        return None

    group = object.__new__(index_group.HiSparseMLAIndexGroup)
    unset = {name: error_reading(group, name) for name in UBATCH_TOPK_FIELDS}
    assert unset == dict.fromkeys(UBATCH_TOPK_FIELDS, AttributeError)

    # vLLM 0.34.0's HiSparse group records on the accelerator's current stream.
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *args: FakeStream())
    group.has_indexer, group.logical_topk_ready = True, torch.Event()
    group.set_logical_topk_ready(0)
    assert group.logical_topk_ready.recorded_by == 0


def test_dbo_ubatch_the_retired_layout_switch_changes_nothing(fake_gpu, monkeypatch):
    """VLLM_DSA_DBO_LAYOUT, whatever its value, no longer picks a layout."""
    monkeypatch.setenv("VLLM_DSA_DBO_LAYOUT", "copies")
    stack = SharedTopkStack(LEADERS, num_ubatches=2)
    group = stack.impls[1].index_group
    assert group.ubatch_topk_states[0].rows is group.physical_topk_indices
    assert [(r.layer, r.ubatch) for r in stack.run_step() if not r.ok] == []
