"""The `half_fix` arm: the fix with only the converted (physical) top-k state per DBO
microbatch, and the logical top-k buffer left shared, as the upstream prototype that scored
like the full fix on GSM8K.

Test-only: the harness plugin installs it in every vLLM process when `ENV` is `1`, and the
product has no switch that reaches it. Decode steps (at most `max_decode_rows + 1` rows per
microbatch) read only the converted state and come out right; longer steps convert from the
logical buffer in every follower, which the other microbatch's leader has overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

ENV = "VLLM_DSA_DBO_HARNESS_HALF_FIX"
GATE = "half_fix: logical top-k shared, converted state per microbatch"


def _shared_logical(self):
    """Every microbatch's logical top-k at row 0: microbatch 0's rows."""
    return self.buffer


def install() -> Callable[[], None]:
    """Make the fix a half fix in this process; returns what undoes it."""
    from vllm_dsa_dbo import core

    stock = core.UbatchLogicalTopk.ubatch_rows
    core.UbatchLogicalTopk.ubatch_rows = _shared_logical

    def undo() -> None:
        core.UbatchLogicalTopk.ubatch_rows = stock

    return undo


@contextmanager
def installed() -> Iterator[None]:
    """The half fix in force for the code under it (CPU tests)."""
    undo = install()
    try:
        yield
    finally:
        undo()
