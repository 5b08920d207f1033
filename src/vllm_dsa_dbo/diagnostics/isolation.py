"""Opt-in checker: no layer reads top-k state another microbatch or step wrote.

`VLLM_DSA_DBO_CHECK=raise` raises at the first bad read; `audit` logs each (writer,
reader, state) once and counts every bad read, so it can audit stock vLLM with the fix
off. Either mode also counts the steps in which a microbatch converted its top-k per
layer because its rows ran past a group's converted rows from its token offset. Unset,
nothing is installed. Host-side bookkeeping at the hand-offs (`PATCHES`, applied only
when it is on): each write (a leader's `record_logical_topk_ready()`, a
group's `_convert_once()` at layer 0, a DeepSeek-V4.1 index or candidate source) stamps
the state object with the microbatch and the step's forward context; each read inside a
forward compares. Eager steps and CUDA-graph capture run Python, so both are checked; a
torch.compile'd model records the leader's logical top-k only while traced, so there only
the physical state is checked.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_dsa_dbo import settings
from vllm_dsa_dbo.patches import apply_all
from vllm_dsa_dbo.patches._shared import Patch
from vllm_dsa_dbo.settings import CHECK_ENV, CHECK_MODES


class MicrobatchIsolationError(RuntimeError):
    """A layer read top-k state written by another microbatch or step."""


@dataclass(frozen=True)
class Stamp:
    ubatch: int
    step: int | None
    layer: str


class IsolationChecker:
    def __init__(self, mode: str) -> None:
        if mode not in CHECK_MODES:
            raise ValueError(f"{CHECK_ENV} must be one of {CHECK_MODES}, got {mode!r}")
        self.mode = mode
        self.violations: Counter[tuple[str, str, str]] = Counter()
        self.checked_reads = 0
        self.past_workspace_steps = 0
        self._past_workspace_step: dict[int, int | None] = {}
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
                # Keep the object alive so its key cannot be reused.
                self._last_write[_key(obj)] = (obj, stamp)

    def read(self, layer: str, kind: str, obj: Any) -> None:
        reader = self._stamp(layer)
        # Outside a forward no microbatch runs and no top-k is consumed: a
        # metadata builder sizing its buffers from the shape (FlashInfer SM90).
        if reader.step is None:
            return
        with self._lock:
            self.checked_reads += 1
            entry = self._last_write.get(_key(obj))
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
            settings.logger().warning("microbatch isolation violated: %s", message)

    def past_workspace(self) -> None:
        """The calling microbatch converts per layer in this step, where from row 0 it would
        have converted once for its group."""
        stamp = self._stamp("")
        with self._lock:
            if self._past_workspace_step.get(stamp.ubatch, -1) != stamp.step:
                self._past_workspace_step[stamp.ubatch] = stamp.step
                self.past_workspace_steps += 1


def _key(obj: Any) -> tuple[bool, int]:
    """A tensor by the address of its first row (layout "offsets" hands out a new view of
    the same rows at every read), anything else by identity."""
    import torch

    if isinstance(obj, torch.Tensor):
        return True, obj.data_ptr()
    return False, id(obj)


CHECKER: IsolationChecker | None = None


def state_of(group: Any) -> Any:
    """The state this microbatch uses: the fix's own, or stock vLLM's one."""
    return group._topk_state() if hasattr(group, "_topk_state") else group


# The checker's seams, applied by `install` after the fix's patches -----------------


def _check_index_group(target: ModuleType) -> None:
    checker = CHECKER
    group_cls = target.SparseMLAIndexGroup
    stock_convert = group_cls._convert_once

    @functools.wraps(stock_convert)
    def _convert_once(
        self: Any, layer_index: int, logical_topk_indices: Any, *args: Any, **kwargs: Any
    ) -> Any:
        state = state_of(self)
        num_tokens = logical_topk_indices.shape[0]
        cached = num_tokens <= state.physical_topk_indices.shape[0]
        if not cached and layer_index == 0 and num_tokens <= _workspace_rows(state):
            checker.past_workspace()
        if cached and layer_index > 0:
            layer = checker.layer(self, layer_index)
            checker.read(layer, "physical top-k", state.physical_topk_indices)
            checker.read(layer, "valid counts", state.valid_topk_counts)
            checker.read(layer, "physical-ready event", state.physical_topk_ready)
        out = stock_convert(self, layer_index, logical_topk_indices, *args, **kwargs)
        if cached and layer_index == 0:
            checker.write(
                checker.layer(self, 0),
                state.physical_topk_indices,
                state.valid_topk_counts,
                state.physical_topk_ready,
            )
        return out

    group_cls._convert_once = _convert_once


def _workspace_rows(state: Any) -> int:
    """A group's converted rows from row 0 (an extra microbatch's state holds them whole)."""
    return getattr(state, "rows", state.physical_topk_indices).shape[0]


def _check_sparse_mla_attention(target: ModuleType) -> None:
    from torch.compiler import is_dynamo_compiling

    checker = CHECKER
    impl_cls = target.SparseMLACommonImpl
    stock_record = impl_cls.record_logical_topk_ready

    @functools.wraps(stock_record)
    def record_logical_topk_ready(self: Any) -> None:
        stock_record(self)
        if is_dynamo_compiling():  # traced once, not a run-time write
            return
        group = self.index_group
        if group is not None and group.has_indexer and self.index_group_index == 0:
            checker.write(
                checker.layer(group, 0),
                self.topk_indices_buffer,
                state_of(group).logical_topk_ready,
            )

    mixin = target.SharedTopkIndicesBuffer
    stock_buffer = mixin.topk_indices_buffer

    @functools.wraps(stock_buffer.fget)
    def topk_indices_buffer(self: Any) -> Any:
        buffer = stock_buffer.fget(self)
        group = getattr(self, "index_group", None)
        index = getattr(self, "index_group_index", 0)
        # A follower: in its leader's group, or in a private one (HYV4, ROCm DSA).
        if group is not None and (index > 0 or not group.has_indexer):
            checker.read(checker.layer(group, index), "logical top-k", buffer)
        return buffer

    impl_cls.record_logical_topk_ready = record_logical_topk_ready
    mixin.topk_indices_buffer = property(topk_indices_buffer, stock_buffer.fset)


def checked_v41_layer(checker: IsolationChecker, stock: Callable[..., None]) -> Callable[..., None]:
    """DeepSeek-V4.1's `_sparse_indexer_and_attn`, checking its hand-offs.

    Before the layer runs: a layer reusing an index source's top-k reads the
    top-k buffer, an indexer masking with earlier candidates reads the
    candidate-block buffer. After it: an index source has written the top-k
    (its indexer op, or the short-context fill before it), the candidate
    source's op the candidates.
    """
    from vllm_dsa_dbo.diagnostics.refusals import reads_candidates, reuses_topk

    @functools.wraps(stock)
    def _sparse_indexer_and_attn(self: Any, hidden_states: Any, index_q: Any, *args: Any) -> None:
        layer = f"V4.1 layer {self.layer_id}"
        if reuses_topk(self):
            checker.read(layer, "V4.1 top-k", self.topk_indices_buffer)
        if reads_candidates(self) and index_q is not None:
            checker.read(layer, "V4.1 candidate blocks", self.candidate_block_buffer)
        stock(self, hidden_states, index_q, *args)
        if self.indexer is not None:
            checker.write(layer, self.topk_indices_buffer)
            writes = self.layer_id == self.candidate_source_layer and index_q is not None
            if writes and self.candidate_block_buffer is not None:
                checker.write(layer, self.candidate_block_buffer)

    return _sparse_indexer_and_attn


def _check_deepseek_v41_attention(target: ModuleType) -> None:
    layer = target.DeepseekV4Attention
    layer._sparse_indexer_and_attn = checked_v41_layer(CHECKER, layer._sparse_indexer_and_attn)


_ONLY_WHEN_ON = "Only with VLLM_DSA_DBO_CHECK=raise or audit, after the fix's patches: "
_checker_patch = functools.partial(
    Patch, upstream="none: a diagnostic", remove_when="with the isolation checker"
)
PATCHES = (
    _checker_patch(
        name="isolation_sparse_mla_attention",
        fits={"0.33.0": "4ac74d5a29181b8b", "0.34.0": "4cccd65d118bfbdc"},
        target="vllm.model_executor.layers.attention.sparse_mla_attention",
        replaces=(
            "SparseMLACommonImpl.record_logical_topk_ready",
            "SharedTopkIndicesBuffer.topk_indices_buffer",
        ),
        why=(
            "The isolation checker has to see each leader's write of the logical top-k "
            "and its ready event, and each follower's read of the logical buffer."
        ),
        how=(
            f"{_ONLY_WHEN_ON}record_logical_topk_ready stamps the buffer and event a leader "
            "wrote, and the topk_indices_buffer getter checks what a follower reads against it."
        ),
        apply=_check_sparse_mla_attention,
    ),
    _checker_patch(
        name="isolation_index_group",
        fits={"0.33.0": "e9c375f0fee72ab4", "0.34.0": "ff5c2c403d650a87"},
        target="vllm.v1.attention.backends.mla.index_group",
        replaces=("SparseMLAIndexGroup._convert_once",),
        why=(
            "The isolation checker has to see each leader's write of the physical "
            "top-k, valid counts and ready event, and each follower's read of them."
        ),
        how=(
            f"{_ONLY_WHEN_ON}_convert_once stamps that state at layer 0 and checks it at a "
            "follower, in the microbatch's state with the fix, in the group's own without."
        ),
        apply=_check_index_group,
    ),
    _checker_patch(
        name="isolation_deepseek_v41_attention",
        fits={"0.33.0": "ede4698093c56845", "0.34.0": "16c20ca72f8b3533"},
        target="vllm.models.deepseek_v41.attention",
        replaces=("DeepseekV4Attention._sparse_indexer_and_attn",),
        why=(
            "The isolation checker has to see DeepSeek-V4.1's hand-offs outside index "
            "groups: the top-k an index source writes for later layers, and the "
            "candidate blocks the candidate source writes for later indexers."
        ),
        how=(
            f"{_ONLY_WHEN_ON}_sparse_indexer_and_attn checks the top-k and candidate blocks "
            "a layer reads before it runs and stamps what it wrote after."
        ),
        apply=_check_deepseek_v41_attention,
    ),
)


def install(mode: str) -> IsolationChecker:
    """Hang a checker on the hand-off points (`PATCHES`), after the fix's patches; once per
    process."""
    global CHECKER
    if CHECKER is None:
        CHECKER = IsolationChecker(mode)
        apply_all(PATCHES)
    return CHECKER
