"""CPU stand-ins for a GPU and a GLM-5-shaped stack of vLLM's real sparse MLA layers.

Used by `vllm-dsa-dbo demo`, the benches and the tests; importing it changes
nothing.
"""

from __future__ import annotations

import os


def use_cpu() -> None:
    """Set the environment the CPU runs need; call it before vLLM is imported.

    The logical -> physical conversion is a Triton kernel: it runs interpreted.
    vLLM swaps Triton for a placeholder on a host with no GPU driver unless the
    visible-device list is empty (as under Ray), so that list is emptied.
    """
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
