"""The harness's step timing on Model Runner V2 (vLLM 0.34.0's only DBO runner), on CPU: its
hooks on vLLM's real `UBatchRunner.run` and `CudaGraphManager.run_fullgraph` count and time
each microbatched forward (eager, and a FULL graph replay of a microbatched descriptor), and
leave a replay of one microbatch alone, as `perf_*` runs read them back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fresh

# The hooks as register() installs them in a worker; vLLM's own run() and run_fullgraph() run
# on stand-ins for the runner's threads and the captured graphs, and device syncs are counted.
PROBE = """
import json
from types import SimpleNamespace
import torch
from vllm_dsa_dbo.demo import use_cpu
use_cpu()
syncs = []
torch.cuda.synchronize = lambda *a: syncs.append(1)
import dsa_dbo_harness
from dsa_dbo_harness import COUNTS, MEASURED, runner_name, start_measuring
dsa_dbo_harness.register()
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu import cudagraph_utils, model_runner, ubatch_utils

threads_run = []
runner = SimpleNamespace(
    begin_capturable_run=lambda model, inputs, state: lambda: threads_run.append(1) or "out"
)
replays = []
def desc(num_ubatches):
    return cudagraph_utils.BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8, num_ubatches=num_ubatches
    )
graphs = SimpleNamespace(graphs={
    desc(n): SimpleNamespace(replay=lambda n=n: replays.append(n)) for n in (1, 2)
})
ubatch_utils.UBatchRunner.run(runner, None, {}, None)  # before start_measuring: not timed
start_measuring(None)
outs = [ubatch_utils.UBatchRunner.run(runner, None, {}, None) for _ in range(3)]
for n in (2, 1, 2):
    cudagraph_utils.CudaGraphManager.run_fullgraph(graphs, desc(n))
print("RESULT " + json.dumps({
    "outs": outs,
    "threads_run": len(threads_run),
    "replays": replays,
    "counts": dict(COUNTS),
    "timed": len(MEASURED["seconds"]),
    "positive": all(s > 0 for s in MEASURED["seconds"]),
    "syncs": len(syncs),
    "runner": runner_name(object.__new__(model_runner.GPUModelRunner)),
}))
"""


def test_v2_microbatched_forwards_are_counted_and_timed():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env |= {
        "VLLM_DSA_DBO_HARNESS": "1",
        "VLLM_DSA_DBO_HARNESS_GATES": "0",
        "VLLM_DSA_DBO_HARNESS_MEASURE": "1",
    }
    result = fresh.python(["-c", PROBE], env, cwd=Path(__file__).parent, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(s for s in result.stdout.splitlines() if s.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert got["outs"] == ["out"] * 3
    assert got["threads_run"] == 4
    assert got["replays"] == [2, 1, 2]
    assert got["counts"]["eager_steps"] == 4
    assert got["counts"]["graph_replays"] == 2
    assert got["counts"]["ubatched_calls"] == 6
    # Three eager forwards and two microbatched replays after start_measuring, two syncs each.
    assert got["timed"] == 5 and got["positive"]
    assert got["syncs"] == 10
    assert got["runner"] == "Model Runner V2"
