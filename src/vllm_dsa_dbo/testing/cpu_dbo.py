"""Run vLLM's DBO microbatch threads on a CPU, for the demo, the benches and the tests.

Everything here is vLLM's own code (microbatch contexts and threads, index
groups, sparse MLA impls, the Triton top-k conversion under Triton's
interpreter) except CUDA streams and events, which get CPU stand-ins. Call
`vllm_dsa_dbo.testing.use_cpu()` before vLLM is imported.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from vllm.utils import torch_utils
from vllm.v1.worker.ubatching import (
    dbo_current_ubatch_id,
    make_ubatch_contexts,
)


class FakeEvent:
    """Remembers which microbatch recorded it last."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.recorded_by: int | None = None

    def record(self, stream: object = None) -> None:
        self.recorded_by = dbo_current_ubatch_id()


class FakeStream:
    """Logs every event wait as (waiting microbatch, event, its recorder)."""

    waits: list[tuple[int, FakeEvent, int | None]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._outer: list[object] = []

    def wait_event(self, event: FakeEvent) -> None:
        FakeStream.waits.append((dbo_current_ubatch_id(), event, event.recorded_by))

    def wait_stream(self, stream: object) -> None:
        pass

    def __enter__(self) -> FakeStream:
        self._outer.append(torch_utils.current_stream())
        set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        set_stream(self._outer.pop())


def set_stream(stream: object) -> None:
    torch_utils._current_stream_tls.value = stream


@contextmanager
def fake_streams() -> Iterator[None]:
    """torch's stream and event constructors make the CPU stand-ins."""
    saved = torch.Event, torch.Stream, torch.cuda.set_stream
    FakeStream.waits = []
    torch.Event, torch.Stream, torch.cuda.set_stream = FakeEvent, FakeStream, set_stream
    set_stream(FakeStream())
    try:
        yield
    finally:
        torch.Event, torch.Stream, torch.cuda.set_stream = saved
        set_stream(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def cpu_vllm() -> Iterator[object]:
    """A CPU vLLM config in force and a one-rank gloo world, as a worker has."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        yield config


def run_dbo_step(step: Callable[[int], None], num_ubatches: int = 2, stream: object = None) -> None:
    """Run `step(ubatch_id)` in vLLM's microbatch threads, as UBatchWrapper does.

    Each thread enters a real `UBatchContext`; `dbo_yield()` inside `step`
    hands over to the next microbatch exactly as the MoE's dispatch does.
    `stream` is the shared compute/comm stream: a real CUDA stream on a GPU,
    the CPU stand-in by default.
    """
    from vllm import forward_context
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import create_forward_context

    stream = FakeStream() if stream is None else stream
    barrier = threading.Barrier(num_ubatches + 1)
    config = get_current_vllm_config()
    contexts = make_ubatch_contexts(
        num_ubatches,
        compute_stream=stream,
        comm_stream=stream,
        forward_contexts=[create_forward_context(None, config) for _ in range(num_ubatches)],
        ready_barrier=barrier,
    )
    errors: list[BaseException] = []

    def thread_main(context) -> None:
        if isinstance(stream, FakeStream):
            set_stream(stream)
        else:
            torch.cuda.set_stream(stream)
        try:
            with context:
                step(context.id)
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=thread_main, args=(c,), daemon=True) for c in contexts]
    # Each context sets vLLM's one global forward context; the step's caller
    # gets its own back, as vLLM's outer set_forward_context gives it.
    outer = forward_context._forward_context
    try:
        for t in threads:
            t.start()
        barrier.wait()
        contexts[0].cpu_wait_event.set()
        # A microbatch that raises leaves its peer waiting at its next yield, as
        # in vLLM: report the error rather than wait for the peer.
        deadline = time.monotonic() + 60
        while (alive := [t for t in threads if t.is_alive()]) and not errors:
            if time.monotonic() > deadline:
                raise RuntimeError("a microbatch thread hung")
            alive[0].join(0.01)
    finally:
        forward_context._forward_context = outer
    if errors:
        raise errors[0]
