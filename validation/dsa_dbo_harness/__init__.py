"""Harness-only vLLM plugin: real DBO on CUDA GPUs, with DeepEP or without.

vLLM 0.33.0 and 0.34.0 microbatch only with data parallelism and an all2all backend
that yields. With DeepEP (`deepep_high_throughput`, `deepep_low_latency`, on
vLLM's own DBO allow-list) nothing needs lifting: run with
`VLLM_DSA_DBO_HARNESS_GATES=0` and vLLM runs unmodified. Without DeepEP the
naive all-gather/reduce-scatter prepare/finalize yields to the peer microbatch
around its collectives, and vLLM already runs it under DBO on ROCm; two CUDA
gates keep it off, and by default this plugin lifts them in every vLLM process
(recorded in `GATES`). In every case, with `VLLM_DSA_DBO_HARNESS=1`, it
re-initialises `--load-format dummy` weights so outputs depend on attention,
and counts microbatched steps in each worker (logged, for `vllm serve`, and
read back through `collective_rpc`), through V1's `UBatchWrapper` (0.33.0) or
Model Runner V2's `UBatchRunner` (0.34.0's only DBO path). With
`VLLM_DSA_DBO_HARNESS_MEASURE=1` it also times microbatched forwards and profiles
one; with `VLLM_DSA_DBO_HARNESS_HALF_FIX=1` it turns the fix into the test-only
half fix (`half_fix.py`). It is never installed with the product.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import textwrap
import threading
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from types import CodeType

from dsa_dbo_harness import half_fix

ENABLE_ENV = "VLLM_DSA_DBO_HARNESS"
# "0": lift no vLLM check and inject no yield (DeepEP runs).
GATES_ENV = "VLLM_DSA_DBO_HARNESS_GATES"
MEASURE_ENV = "VLLM_DSA_DBO_HARNESS_MEASURE"
# Python's thread switch interval (seconds) in every vLLM process, if set.
SWITCH_INTERVAL_ENV = "VLLM_DSA_DBO_HARNESS_SWITCH_INTERVAL"
# The microbatched forward (counted from `start_measuring`) that is profiled.
PROFILED_FORWARD = 20
# Host operators of the profiled forward kept, by time of their own.
HOST_OPS = 25
# The product's functions of the frame-timed forward kept, by self time.
BUSIEST_FRAMES = 12
# Log every Nth microbatched forward of a worker (and the first), with the checker's counts.
LOG_EVERY_ENV = "VLLM_DSA_DBO_HARNESS_LOG_EVERY"

# Per process, read back through collective_rpc: microbatched forwards by kind,
# and with MEASURE_ENV the measurements below.
COUNTS: Counter[str] = Counter()
MEASURED: dict = {"from_call": None, "seconds": [], "profile": None, "fix_frames": None}
# What this process changed in vLLM's own checks and yields.
GATES: list[str] = []
# What this process changed in the product (the test-only half fix).
VARIANTS: list[str] = []
V1_RUNNER = "V1 runner"
V2_RUNNER = "Model Runner V2"


def register() -> None:
    if os.environ.get(ENABLE_ENV) != "1":
        return
    import vllm.config.vllm as config_module

    if getattr(config_module, "_dsa_dbo_harness", False):
        return
    if os.environ.get(GATES_ENV, "1") != "0":
        _allow_naive_all2all_under_dbo(config_module)
        _naive_prepare_finalize_yields()
        GATES.extend(
            [
                "dbo_all2all_allow_list+allgather_reducescatter",
                "naive_dp_ep.supports_dbo=True",
                "naive_dp_ep.yield_at_graph_capture",
            ]
        )
    if os.environ.get(half_fix.ENV) == "1":
        half_fix.install()
        VARIANTS.append(half_fix.GATE)
    _stream_capture_check_for_older_torch()
    _reinit_dummy_weights()
    _count_microbatched_steps()
    if os.environ.get(SWITCH_INTERVAL_ENV):
        sys.setswitchinterval(float(os.environ[SWITCH_INTERVAL_ENV]))
    config_module._dsa_dbo_harness = True


def _stream_capture_check_for_older_torch() -> None:
    """vLLM 0.33.0's batched MoE experts ask `torch.Stream.is_capturing()`, which
    the GPU bundle's torch 2.11 lacks (vLLM pins a newer torch): ask CUDA instead.

    Only DeepEP low-latency reaches that code here; recorded in `GATES` when called.
    """
    import torch

    if hasattr(torch.Stream, "is_capturing"):
        return
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

    gate = "fused_batched_moe.capture_check=torch.cuda (torch.Stream lacks is_capturing)"

    def capturing_or_compiling() -> bool:
        if torch.compiler.is_compiling():
            return True
        if gate not in GATES:
            GATES.append(gate)
        return torch.cuda.is_current_stream_capturing()

    fused_batched_moe._is_capturing_or_compiling = capturing_or_compiling


def _allow_naive_all2all_under_dbo(config_module) -> None:
    """Add `allgather_reducescatter` to the CUDA DBO backend allow-list.

    The list is a local of `VllmConfig.__post_init__`; the one assertion that
    reads it is rewritten, nothing else in that method changes.
    """
    cls = config_module.VllmConfig
    source = textwrap.dedent(inspect.getsource(cls.__post_init__))
    old = "assert a2a_backend in supported_backends,"
    if source.count(old) != 1:
        raise RuntimeError("vLLM's DBO all2all allow-list moved; update the harness")
    source = source.replace(
        old, 'assert a2a_backend in [*supported_backends, "allgather_reducescatter"],'
    )
    namespace: dict = {}
    exec(compile(source, config_module.__file__, "exec"), config_module.__dict__, namespace)
    cls.__post_init__ = namespace["__post_init__"]


def _naive_prepare_finalize_yields() -> None:
    """Let the naive prepare/finalize run under DBO on CUDA, with yields at
    CUDA-graph capture too.

    Eager: vLLM's own `_comm_region` (yield, collective on the comm stream).
    Capture: vLLM keeps the collective on the capture stream and does not
    yield, so a replayed graph would hold no interleaving. Here it yields to
    the peer microbatch first, as DeepEP low-latency's receive hook does, so
    the captured kernel order is the eager DBO order.
    """
    import torch
    from vllm.model_executor.layers.fused_moe.prepare_finalize import naive_dp_ep
    from vllm.v1.worker.ubatching import dbo_enabled, dbo_yield

    cls = naive_dp_ep.MoEPrepareAndFinalizeNaiveDPEPModular
    stock_region = cls._comm_region

    @contextmanager
    def _comm_region(self):
        if dbo_enabled() and torch.cuda.is_current_stream_capturing():
            dbo_yield()
            yield
            return
        with stock_region(self):
            yield

    cls.supports_dbo = lambda self: True
    cls._comm_region = _comm_region


def _reinit_dummy_weights() -> None:
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    from dsa_dbo_harness.model import reinit_weights

    stock = DummyModelLoader.load_weights

    def load_weights(self, model, model_config):
        stock(self, model, model_config)
        COUNTS["reinitialised_params"] = reinit_weights(model)

    DummyModelLoader.load_weights = load_weights


def start_measuring(worker) -> None:
    """Measure from the next microbatched forward on (after startup)."""
    MEASURED["from_call"] = COUNTS["ubatched_calls"]


def _measured(call):
    """Wall time of one microbatched forward between two device syncs (the
    syncs are outside it, the same for every run); the PROFILED_FORWARD-th is
    profiled instead (CUDA kernels launched, synchronizing calls made, the host
    operators taking the most time of their own, all threads), and the next one
    runs under the product's frame timer."""
    import torch

    index = COUNTS["ubatched_calls"] - MEASURED["from_call"]
    torch.cuda.synchronize()
    if index == PROFILED_FORWARD:
        return _profiled(call, index)
    if index == PROFILED_FORWARD + 1:
        timer = FrameTimer(_product_dir())
        start = time.perf_counter()
        with timer.installed():
            out = call()
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
        costs = hook_costs()
        MEASURED["fix_frames"] = {
            "forward": index,
            "calls": timer.calls,
            "self_us": timer.self_s * 1e6,
            "corrected_self_us": timer.corrected_s(costs) * 1e6,
            "hook_costs_us": {k: v * 1e6 for k, v in costs.items()},
            "timed_wall_us": wall_s * 1e6,
            "busiest": timer.busiest(BUSIEST_FRAMES),
        }
        return out
    start = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    MEASURED["seconds"].append(time.perf_counter() - start)
    return out


def _profiled(call, index: int):
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    all_threads = _all_threads_config()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                experimental_config=all_threads,
            ) as prof,
        ):
            warnings.simplefilter("always")
            out = call()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kernels = Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)
    MEASURED["profile"] = {
        "forward": index,
        "cuda_kernels": sum(kernels.values()),
        "kernels_by_name": dict(kernels),
        "sync_warnings": sum("synchroniz" in str(w.message) for w in caught),
        "host_ops_all_threads": all_threads is not None,
        "host_ops_by_self_time": [
            {
                "name": e.key,
                "calls": e.count,
                "self_cpu_us": e.self_cpu_time_total,
                "cpu_us": e.cpu_time_total,
            }
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:HOST_OPS]
        ],
    }
    return out


def _product_dir() -> str:
    import vllm_dsa_dbo

    return os.path.dirname(vllm_dsa_dbo.__file__) + os.sep


class FrameTimer:
    """Self time of the Python frames of the files under one directory, in the
    calling thread and every thread started while installed.

    vLLM starts its microbatch threads anew in each forward, after a profiler
    started around the forward would have; torch's Python tracer never sees
    them, so a profile hook does the timing. C calls count to the frame making
    them, Python calls to the callee. The hook's own cost falls partly into the
    frames it times, so `self_s` is an upper bound; `corrected_s` takes off what
    the hook adds per frame, per C call and per Python call (`hook_costs`).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        # Per code object timed: [calls, self seconds, C calls, Python calls].
        self.functions: dict[CodeType, list] = {}
        self._lock = threading.Lock()
        self._stacks = threading.local()

    def __call__(self, frame, event: str, arg) -> None:
        now = time.perf_counter()
        stack = self._stacks.__dict__.setdefault("frames", [])
        if event == "call":
            if stack and stack[-1][2] is not None:
                stack[-1][4] += 1
            code = frame.f_code
            ours = code.co_filename.startswith(self.directory)
            stack.append([now, 0.0, code if ours else None, 0, 0])
            return
        if event == "c_call":
            if stack and stack[-1][2] is not None:
                stack[-1][3] += 1
            return
        if event != "return" or not stack:
            return
        start, children, code, c_calls, py_calls = stack.pop()
        if stack:
            stack[-1][1] += now - start
        if code is not None:
            with self._lock:
                tally = self.functions.setdefault(code, [0, 0.0, 0, 0])
                tally[0] += 1
                tally[1] += now - start - children
                tally[2] += c_calls
                tally[3] += py_calls

    def _total(self, field: int) -> float:
        return sum(tally[field] for tally in self.functions.values())

    @property
    def calls(self) -> int:
        return self._total(0)

    @property
    def self_s(self) -> float:
        return self._total(1)

    def corrected_s(self, costs: dict[str, float]) -> float:
        return (
            self.self_s
            - self.calls * costs["frame"]
            - self._total(2) * costs["c_call"]
            - self._total(3) * costs["py_call"]
        )

    def busiest(self, n: int) -> list[dict]:
        """The `n` functions with the most self time."""
        rows = sorted(self.functions.items(), key=lambda item: -item[1][1])[:n]
        return [
            {
                "function": f"{os.path.basename(code.co_filename)}:{code.co_qualname}",
                "calls": calls,
                "self_us": self_s * 1e6,
                "c_calls": c_calls,
                "py_calls": py_calls,
            }
            for code, (calls, self_s, c_calls, py_calls) in rows
        ]

    @contextmanager
    def installed(self):
        threading.setprofile(self)
        sys.setprofile(self)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


_CALIBRATION_FILE = "<frame-timer-calibration>"
_CALIBRATION = compile(
    "def frame():\n    pass\ndef c_call():\n    len(())\ndef py_call():\n    callee()\n",
    _CALIBRATION_FILE,
    "exec",
)


def hook_costs(repeats: int = 20_000) -> dict[str, float]:
    """Seconds a FrameTimer adds to the self time it reports, per frame and per
    C or Python call a frame makes: its readings of frames that do only that.
    Subtracting them also takes off the calls' own few tens of ns."""
    namespace = {"callee": lambda: None}
    exec(_CALIBRATION, namespace)
    read = {}
    for name in ("frame", "c_call", "py_call"):
        timer, fn = FrameTimer(_CALIBRATION_FILE), namespace[name]
        with timer.installed():
            for _ in range(repeats):
                fn()
        read[name] = timer.self_s / repeats
    return {
        "frame": read["frame"],
        "c_call": read["c_call"] - read["frame"],
        "py_call": read["py_call"] - read["frame"],
    }


def _all_threads_config():
    """A profiler config recording the microbatch threads' operators too
    (torch >= 2.8), else None: only the calling thread's."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def runner_name(model_runner: object) -> str:
    """Which vLLM GPU model runner a worker runs (vLLM 0.34.0 has only V2)."""
    module = type(model_runner).__module__
    return V2_RUNNER if module.startswith("vllm.v1.worker.gpu.") else V1_RUNNER


def _count_microbatched_steps() -> None:
    """Count, per worker, forwards and those run as microbatches, whichever runner runs them:
    V1's `UBatchWrapper` (vLLM 0.33.0) or Model Runner V2's `UBatchRunner` (0.33.0 with
    VLLM_USE_V2_MODEL_RUNNER=1, and 0.34.0's only DBO path)."""
    from vllm.v1.worker import ubatching

    stock_enter = ubatching.UBatchContext.__enter__

    @functools.wraps(stock_enter)
    def __enter__(self):
        COUNTS[f"ubatch{self.id}_forwards"] += 1
        return stock_enter(self)

    ubatching.UBatchContext.__enter__ = __enter__
    try:
        from vllm.v1.worker import gpu_ubatch_wrapper
    except ImportError:  # vLLM 0.34.0 removed the V1 runner
        gpu_ubatch_wrapper = None
    if gpu_ubatch_wrapper is not None:
        _count_v1_wrapper(gpu_ubatch_wrapper.UBatchWrapper)
        from vllm.v1.worker import gpu_model_runner

        _name_runner(gpu_model_runner.GPUModelRunner, V1_RUNNER)
    _count_v2_runner()


def _name_runner(runner_cls: type, runner: str) -> None:
    """Log which runner and release a worker runs once it builds its model runner: a DBO-off
    run logs no microbatched forward to say it."""
    stock_init = runner_cls.__init__

    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        from vllm.logger import init_logger

        init_logger("vllm.dsa_dbo_harness").info(
            "dsa_dbo_harness: worker on %s, vLLM %s", runner, _vllm_version()
        )

    runner_cls.__init__ = __init__


def _microbatched(runner: str, call):
    """One microbatched forward: counted, logged every LOG_EVERY_ENV-th, measured if asked."""
    from vllm.logger import init_logger

    from vllm_dsa_dbo.diagnostics import isolation

    COUNTS["ubatched_calls"] += 1
    calls = COUNTS["ubatched_calls"]
    if calls == 1 or calls % int(os.environ.get(LOG_EVERY_ENV, "50")) == 0:
        checker = isolation.CHECKER
        checked = (
            ""
            if checker is None
            else f"; checker {checker.checked_reads} reads, {sum(checker.violations.values())} bad"
            f", {checker.past_workspace_steps} steps past the workspace"
        )
        gates = f"; harness gates: {', '.join(GATES)}" if GATES else ""
        variants = f"; variant: {', '.join(VARIANTS)}" if VARIANTS else ""
        init_logger("vllm.dsa_dbo_harness").info(
            "dsa_dbo_harness: %d microbatched forwards of %d%s; %s, vLLM %s%s%s",
            calls,
            COUNTS["calls"],
            checked,
            runner,
            _vllm_version(),
            gates,
            variants,
        )
    if os.environ.get(MEASURE_ENV) == "1" and MEASURED["from_call"] is not None:
        return _measured(call)
    return call()


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _count_v1_wrapper(wrapper: type) -> None:
    """V1: `UBatchWrapper.__call__` runs every forward; microbatched when it has slices."""
    for name, key in (("_run_ubatches", "eager_steps"), ("_capture_ubatches", "graph_captures")):
        stock = getattr(wrapper, name)

        def counted(self, *args, _stock=stock, _key=key, **kwargs):
            COUNTS[_key] += 1
            return _stock(self, *args, **kwargs)

        setattr(wrapper, name, counted)

    stock_call = wrapper.__call__

    def __call__(self, *args, **kwargs):
        from vllm.forward_context import get_forward_context

        COUNTS["calls"] += 1
        if get_forward_context().ubatch_slices is None:
            return stock_call(self, *args, **kwargs)
        return _microbatched(V1_RUNNER, lambda: stock_call(self, *args, **kwargs))

    wrapper.__call__ = __call__


def _count_v2_runner() -> None:
    """Model Runner V2: `execute_model` runs every forward (dummy ones too); `UBatchRunner.run`
    an eager microbatched one, a FULL graph replay of a microbatched descriptor a captured
    one; `begin_capturable_run(for_capture=True)` a capture."""
    from vllm.v1.worker.gpu import cudagraph_utils, model_runner, ubatch_utils

    runner_cls = model_runner.GPUModelRunner
    _name_runner(runner_cls, V2_RUNNER)
    stock_execute = runner_cls.execute_model

    def execute_model(self, *args, **kwargs):
        COUNTS["calls"] += 1
        return stock_execute(self, *args, **kwargs)

    runner_cls.execute_model = execute_model

    ubatch_runner = ubatch_utils.UBatchRunner
    stock_run = ubatch_runner.run
    stock_begin = ubatch_runner.begin_capturable_run

    def run(self, *args, **kwargs):
        COUNTS["eager_steps"] += 1
        return _microbatched(V2_RUNNER, lambda: stock_run(self, *args, **kwargs))

    def begin_capturable_run(self, *args, for_capture: bool = False, **kwargs):
        if for_capture:
            COUNTS["graph_captures"] += 1
        return stock_begin(self, *args, for_capture=for_capture, **kwargs)

    ubatch_runner.run = run
    ubatch_runner.begin_capturable_run = begin_capturable_run

    manager = cudagraph_utils.CudaGraphManager
    stock_replay = manager.run_fullgraph

    def run_fullgraph(self, desc, *args, **kwargs):
        if getattr(desc, "num_ubatches", 1) <= 1:
            return stock_replay(self, desc, *args, **kwargs)
        COUNTS["graph_replays"] += 1
        return _microbatched(V2_RUNNER, lambda: stock_replay(self, desc, *args, **kwargs))

    manager.run_fullgraph = run_fullgraph
