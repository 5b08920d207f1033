"""Opt-in checker: no layer reads top-k state another microbatch or step wrote.

`VLLM_DSA_DBO_CHECK=raise` raises `MicrobatchIsolationError` at the first bad
read; `VLLM_DSA_DBO_CHECK=audit` logs each (writer, reader, state) once and
counts every bad read, so it can audit vLLM's stock state with the fix
disabled. Unset (the default), nothing is installed and nothing costs.

Host-side bookkeeping only, at the three places the hand-off happens (the
`patches/isolation_*` patches, applied only when the checker is on):
- a leader's `record_logical_topk_ready()` writes the logical top-k buffer and
  its ready event;
- a group's `_convert_once()` at layer 0 writes the physical top-k rows, the
  valid counts and their ready event; at a follower it reads them;
- a follower impl's `topk_indices_buffer` reads the logical buffer;
- DeepSeek-V4.1: each layer's `_sparse_indexer_and_attn` reads the top-k of
  the index source below it and the candidate blocks of the candidate source
  before it runs, and writes them after it, as its layer's role says.
Each write stamps the state object (the resolved buffer or event) with the
microbatch and the step's forward context; each read inside a forward
compares (outside one, no microbatch runs). Python runs in
eager steps and during CUDA-graph capture, so both are checked; replays reuse
what capture checked. A torch.compile'd model (the deepseek_v2 DSA path) runs
the leader's `record_logical_topk_ready()` only while it is traced, so there
the logical buffer's reads go unchecked; the physical state is checked.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm_dsa_dbo import env_choice

CHECK_ENV = "VLLM_DSA_DBO_CHECK"
MODES = ("raise", "audit")


class MicrobatchIsolationError(RuntimeError):
    """A layer read top-k state written by another microbatch or step."""


@dataclass(frozen=True)
class Stamp:
    ubatch: int
    step: int | None
    layer: str


class IsolationChecker:
    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"{CHECK_ENV} must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.violations: Counter[tuple[str, str, str]] = Counter()
        self.checked_reads = 0
        self._last_write: dict[int, tuple[Any, Stamp]] = {}
        self._group_names: dict[int, str] = {}
        self._steps = itertools.count()
        self._lock = threading.Lock()

    def layer(self, group: Any, layer_index: int) -> str:
        name = self._group_names.setdefault(id(group), f"group {len(self._group_names)}")
        return f"{name} {'leader' if layer_index == 0 else f'follower {layer_index}'}"

    def _stamp(self, layer: str) -> Stamp:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        from vllm_dsa_dbo.core import current_ubatch_id

        step = None
        if is_forward_context_available():
            context = get_forward_context()
            step = getattr(context, "_dsa_dbo_step", None)
            if step is None:
                step = context._dsa_dbo_step = next(self._steps)
        return Stamp(current_ubatch_id(), step, layer)

    def write(self, layer: str, *objects: Any) -> None:
        stamp = self._stamp(layer)
        with self._lock:
            for obj in objects:
                # Keep the object alive so its id cannot be reused.
                self._last_write[id(obj)] = (obj, stamp)

    def read(self, layer: str, kind: str, obj: Any) -> None:
        reader = self._stamp(layer)
        # Outside a forward no microbatch runs and no top-k is consumed: a
        # metadata builder sizing its buffers from the shape (FlashInfer SM90).
        if reader.step is None:
            return
        with self._lock:
            self.checked_reads += 1
            entry = self._last_write.get(id(obj))
        if entry is None:
            return
        writer = entry[1]
        if (writer.ubatch, writer.step) == (reader.ubatch, reader.step):
            return
        key = (writer.layer, reader.layer, kind)
        self.violations[key] += 1
        message = (
            f"{kind}: {reader.layer} in microbatch {reader.ubatch} (step {reader.step}) "
            f"read what {writer.layer} wrote in microbatch {writer.ubatch} "
            f"(step {writer.step})"
        )
        if self.mode == "raise":
            raise MicrobatchIsolationError(message)
        if self.violations[key] == 1:
            from vllm.logger import init_logger

            from vllm_dsa_dbo import LOGGER_NAME

            init_logger(LOGGER_NAME).warning("microbatch isolation violated: %s", message)


CHECKER: IsolationChecker | None = None


def state_of(group: Any) -> Any:
    """The state this microbatch uses: the fix's copy, or stock vLLM's one."""
    return group._topk_state() if hasattr(group, "_topk_state") else group


def install(mode: str) -> IsolationChecker:
    """Hang a checker on the hand-off points (the patches in `CHECK_PATCH_MODULES`),
    after the fix's patches; once per process."""
    global CHECKER
    if CHECKER is None:
        from vllm_dsa_dbo.patches import CHECK_PATCH_MODULES, apply_all

        CHECKER = IsolationChecker(mode)
        apply_all(CHECK_PATCH_MODULES)
    return CHECKER


def mode_from_env() -> str | None:
    """The checker mode VLLM_DSA_DBO_CHECK asks for; EnvValueError for an unknown value."""
    return env_choice(CHECK_ENV, MODES, "turn the checker on")
