"""Which layers of a DSA model lead (run the indexer) and which follow.

The rule is vLLM 0.33.0's (`DeepseekV32Attention` and `DeepseekV2MLAAttention`
decide `skip_topk` from these config keys); the grouping is
`SparseMLAIndexGroupBuilder.register_layer`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def leader_mask(config: Mapping[str, Any]) -> list[bool]:
    """True for each decoder layer that computes its own top-k."""
    num_layers = config["num_hidden_layers"]
    freq = config.get("index_topk_freq") or 1
    offset = config.get("index_skip_topk_offset", 2)
    pattern = config.get("index_topk_pattern")
    if pattern is None:
        return [max(i - offset + 1, 0) % freq == 0 for i in range(num_layers)]
    return [not (i < len(pattern) and pattern[i] == "S") for i in range(num_layers)]


def group_sizes(leaders: list[bool]) -> list[int]:
    """Layers per index group: a group starts at a leader (or the first layer)."""
    sizes: list[int] = []
    for i, leads in enumerate(leaders):
        if leads or i == 0:
            sizes.append(0)
        sizes[-1] += 1
    return sizes


def groups_with_followers(leaders: list[bool]) -> int:
    return sum(size > 1 for size in group_sizes(leaders))
