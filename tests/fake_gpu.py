"""CPU stand-ins for the CUDA streams and events the top-k hand-off uses.

Everything else in the tests is vLLM's own code: its index groups, sparse MLA
impls, microbatch contexts and threads, and the Triton conversion kernel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from vllm.utils import torch_utils
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, make_ubatch_contexts


class FakeEvent:
    """Remembers which microbatch recorded it last."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.recorded_by: int | None = None

    def record(self, stream: object = None) -> None:
        self.recorded_by = dbo_current_ubatch_id()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeStream:
    """Logs every event wait as (waiting microbatch, event, its recorder)."""

    waits: list[tuple[int, FakeEvent, int | None]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._outer: list[object] = []

    def wait_event(self, event: FakeEvent) -> None:
        FakeStream.waits.append((dbo_current_ubatch_id(), event, event.recorded_by))

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> FakeStream:
        self._outer.append(torch_utils.current_stream())
        set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        set_stream(self._outer.pop())


def set_stream(stream: object) -> None:
    torch_utils._current_stream_tls.value = stream


def install(monkeypatch) -> None:
    """Route torch's stream and event constructors to the fakes."""
    FakeStream.waits = []
    monkeypatch.setattr(torch, "Event", FakeEvent)
    monkeypatch.setattr(torch, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    set_stream(FakeStream())


def run_dbo_step(step: Callable[[int], None], num_ubatches: int = 2) -> None:
    """Run `step(ubatch_id)` in vLLM's microbatch threads, as UBatchWrapper does.

    Each thread enters a real `UBatchContext`; `dbo_yield()` inside `step`
    hands over to the next microbatch exactly as the MoE's dispatch does.
    """
    stream = FakeStream()
    barrier = threading.Barrier(num_ubatches + 1)
    contexts = make_ubatch_contexts(
        num_ubatches,
        compute_stream=stream,
        comm_stream=stream,
        forward_contexts=[None] * num_ubatches,
        ready_barrier=barrier,
    )
    errors: list[BaseException] = []

    def thread_main(context) -> None:
        set_stream(stream)
        try:
            with context:
                step(context.id)
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    threads = [
        threading.Thread(target=thread_main, args=(c,), daemon=True) for c in contexts
    ]
    for t in threads:
        t.start()
    barrier.wait()
    contexts[0].cpu_wait_event.set()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "microbatch thread hung"
    if errors:
        raise errors[0]
