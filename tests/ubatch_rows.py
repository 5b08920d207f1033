"""Where the harness's microbatch 1 finds its top-k: microbatch 0's rows from its offset."""

from __future__ import annotations

import torch

from vllm_dsa_dbo.core import UbatchLogicalTopk
from vllm_dsa_dbo.cpu_dbo import TOKENS_PER_UBATCH


def address(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """A tensor's first element and shape: views of the same rows are equal."""
    return tensor.data_ptr(), tuple(tensor.shape)


def ubatch1_logical(extra: UbatchLogicalTopk) -> tuple[int, tuple[int, ...]]:
    """The address of `extra`'s logical top-k for microbatch 1 of `cpu_dbo.run_dbo_step`."""
    return address(extra.buffer[TOKENS_PER_UBATCH[0] :])
