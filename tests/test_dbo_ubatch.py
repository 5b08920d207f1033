"""Core: shared top-k stays per DBO microbatch through vLLM's real classes."""

from __future__ import annotations

import pytest
import torch

from fake_gpu import FakeStream
from shared_topk import SharedTopkSlice, expected_physical, ubatch_inputs


def follower_mismatches(seen: dict, seed: int = 0) -> list[str]:
    """Every way a follower's read differs from its own microbatch's leader."""
    bad = []
    for u in (0, 1):
        logical, meta = ubatch_inputs(u, seed)
        physical, counts = expected_physical(logical, meta)
        lead_logical, lead_physical, lead_counts = seen["B", u]
        c_logical, c_physical, c_counts = seen["C", u]
        checks = {
            "leader logical": torch.equal(lead_logical, logical),
            "leader physical": torch.equal(lead_physical, physical),
            "follower logical": torch.equal(c_logical, logical),
            "follower physical": torch.equal(c_physical, lead_physical),
            "follower counts": torch.equal(c_counts, lead_counts),
            "writer is reader": seen["writer is reader", u],
        }
        bad += [f"ubatch {u}: {name}" for name, ok in checks.items() if not ok]
    return bad


def foreign_event_waits() -> list[tuple[int, int | None]]:
    """Top-k ready-event waits on an event another microbatch recorded."""
    return [
        (waiter, recorder)
        for waiter, _, recorder in FakeStream.waits
        if recorder is not None and recorder != waiter
    ]


def test_dbo_ubatch_followers_read_their_own_leaders_topk(fake_gpu):
    model = SharedTopkSlice(num_ubatches=2)
    group_a, group_b = model.impl_a.index_group, model.impl_b.index_group
    assert model.impl_c.index_group is group_b and model.impl_c.index_group_index == 1

    assert group_a.ubatch_topk_states == ()
    assert len(group_b.ubatch_topk_states) == 1
    assert len(model.builder.ubatch_logical_topk_indices) == 1
    assert model.builder.follower_groups == [group_b]

    seen = model.run_step()

    assert follower_mismatches(seen) == []
    assert foreign_event_waits() == []
    # The microbatches really differ, so a cross-read would have shown.
    assert not torch.equal(seen["C", 0][1][:4], seen["C", 1][1][:4])


def test_dbo_ubatch_schedule_is_leader0_leader1_followers(fake_gpu):
    """The stock state really is overwritten in this schedule (the bug)."""
    model = SharedTopkSlice(num_ubatches=1)
    seen = model.run_step()
    assert "ubatch 0: follower logical" in follower_mismatches(seen)
    assert "ubatch 0: follower physical" in follower_mismatches(seen)
    assert follower_mismatches(seen)[-1].startswith("ubatch 0")


def test_dbo_ubatch_outside_microbatch_threads_resolves_ubatch0(fake_gpu):
    model = SharedTopkSlice(num_ubatches=2)
    group = model.impl_b.index_group
    assert model.impl_c.topk_indices_buffer is model.buffer
    assert group._topk_state() is group
    assert group.physical_topk_indices is group.__dict__["physical_topk_indices"]


@pytest.mark.parametrize("num_ubatches", [None, 1])
def test_dbo_ubatch_no_dbo_allocates_nothing(fake_gpu, num_ubatches):
    model = SharedTopkSlice(num_ubatches=num_ubatches)
    assert model.builder.num_ubatches == 1
    assert model.builder.ubatch_logical_topk_indices == []
    assert model.impl_b.index_group.ubatch_topk_states == ()
