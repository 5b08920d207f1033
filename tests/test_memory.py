"""Extra memory per microbatch: exactly what the formula says, 0 without followers."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder
from vllm_dsa_dbo.layout import groups_with_followers, leader_mask
from vllm_dsa_dbo.ubatch_topk import (
    ubatch_topk_bytes,
    ubatch_topk_bytes_per_extra_ubatch,
)

MAX_NUM_BATCHED_TOKENS = 96
MAX_DECODE_ROWS = 24
INDEX_TOPK = 256


def glm5_leaders(num_layers: int, freq: int, offset: int) -> list[bool]:
    return leader_mask(
        {"num_hidden_layers": num_layers, "index_topk_freq": freq, "index_skip_topk_offset": offset}
    )


def build(leaders: list[bool], num_ubatches: int) -> SparseMLAIndexGroupBuilder:
    buffer = torch.empty(MAX_NUM_BATCHED_TOKENS, INDEX_TOPK, dtype=torch.int32)
    builder = SparseMLAIndexGroupBuilder(
        buffer, MAX_DECODE_ROWS, num_ubatches=num_ubatches
    )
    for leads in leaders:
        builder.register_layer(leads)
    return builder


@pytest.mark.parametrize(
    "num_layers, freq, offset, expected_groups",
    [(8, 4, 3, 2), (78, 4, 3, 19), (12, 2, 2, 5), (8, 1, 3, 0)],
)
@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_allocated_bytes_match_formula(
    fake_gpu, num_layers, freq, offset, expected_groups, num_ubatches
):
    leaders = glm5_leaders(num_layers, freq, offset)
    builder = build(leaders, num_ubatches)
    g = len(builder.follower_groups)
    assert g == expected_groups == groups_with_followers(leaders)

    extra = num_ubatches - 1
    index_bytes = (MAX_NUM_BATCHED_TOKENS + g * (MAX_DECODE_ROWS + 1)) * INDEX_TOPK * 4
    if g == 0:
        index_bytes = 0
    count_bytes = g * (MAX_DECODE_ROWS + 1) * 4
    assert ubatch_topk_bytes(builder.follower_groups) == extra * (index_bytes + count_bytes)
    assert ubatch_topk_bytes(builder.follower_groups) == extra * ubatch_topk_bytes_per_extra_ubatch(
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_decode_rows=MAX_DECODE_ROWS,
        index_topk=INDEX_TOPK,
        groups_with_followers=g,
    )


def test_glm53_geometry_is_216_mib():
    per_ubatch = ubatch_topk_bytes_per_extra_ubatch(
        max_num_batched_tokens=8192,
        max_decode_rows=1024,
        index_topk=2048,
        groups_with_followers=19,
    )
    index_bytes = (8192 + 19 * 1025) * 2048 * 4
    assert per_ubatch == index_bytes + 19 * 1025 * 4
    assert round(per_ubatch / 2**20) == 216


def test_no_dbo_allocates_nothing(fake_gpu):
    builder = build(glm5_leaders(78, 4, 3), num_ubatches=1)
    assert builder.follower_groups == []
    assert builder.ubatch_logical_topk_indices == []


def test_bad_num_ubatches_is_refused(fake_gpu):
    with pytest.raises(ValueError, match="num_ubatches must be >= 1"):
        build([True], num_ubatches=0)
