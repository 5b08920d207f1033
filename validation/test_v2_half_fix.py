"""The harness on Model Runner V2, and the half fix it serves, on CPU.

One DBO step of a GLM-5-shaped stack of vLLM's real sparse MLA layers
(`vllm_dsa_dbo.cpu_dbo.SharedTopkStack`), run as the model of vLLM's own V2 `UBatchRunner`
(0.34.0's only DBO path): its microbatch threads, its forward contexts, its merge. The
harness plugin counts that step in the worker, as on a GPU. Steps of decode size (at most
`max_decode_rows + 1` rows a microbatch) read the converted top-k; longer ones (prefill
split across microbatches) convert from the logical buffer in every follower. The half fix
(converted state per microbatch, logical buffer shared) is right on the first and wrong on
the second; the fix is right on both, stock on neither.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fresh

# One worker process: the product and the harness registered as vLLM registers them, then a
# step of each length through UBatchRunner.run. Prints what every follower read.
PROBE = """
import faulthandler, json, sys, threading
faulthandler.dump_traceback_later(300, exit=True)  # a microbatch that raises parks its peer
from contextlib import nullcontext
from types import SimpleNamespace
import torch
from vllm_dsa_dbo.demo import use_cpu
use_cpu()
import vllm_dsa_dbo, dsa_dbo_harness
from vllm_dsa_dbo import cpu_dbo
from vllm_dsa_dbo.cpu_dbo import GLM5_LAYOUT, SharedTopkStack
from vllm_dsa_dbo.diagnostics.layout import leader_mask

vllm_dsa_dbo.register()
dsa_dbo_harness.register()
from vllm.forward_context import create_forward_context
from vllm.utils import torch_utils
from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, UBatchState
from vllm.v1.worker.ubatch_utils import UBatchSlice
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_yield

fixed = sys.argv[1] != "stock"
leaders = leader_mask(GLM5_LAYOUT)
found = {}
for length, tokens in json.loads(sys.argv[2]).items():
    cpu_dbo.TOKENS_PER_UBATCH = tuple(tokens)
    with cpu_dbo.cpu_vllm() as config, cpu_dbo.fake_streams():
        stream = torch_utils.current_stream()
        # Each microbatch thread selects its device first: on a CPU, the stand-in stream.
        torch.accelerator.set_device_index = lambda index: cpu_dbo.set_stream(stream)
        stack = SharedTopkStack(leaders, 2 if fixed else None)
        raw = {}

        def model(input_ids, positions):
            ubatch = dbo_current_ubatch_id()
            for layer, leads in enumerate(leaders):
                if leads:
                    stack.lead(layer, stack.inputs[ubatch, layer])
                raw[layer, ubatch] = stack._read(layer, ubatch)
                dbo_yield()
            return input_ids.float()

        runner = UBatchRunner.__new__(UBatchRunner)
        runner.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
        runner.num_ubatches = 2
        runner.device = torch.device("cpu")
        runner.comm_stream = runner.capture_stream = stream
        runner.ready_barrier = threading.Barrier(3)
        runner.sm_control, runner._pending_finish = nullcontext(), None
        first, second = tokens
        slices = [
            UBatchSlice(slice(0, 1), slice(0, first)),
            UBatchSlice(slice(1, 2), slice(first, first + second)),
        ]
        state = UBatchState(slices, [create_forward_context(None, config) for _ in slices])
        ids = torch.arange(first + second)
        merged = runner.run(model, {"input_ids": ids, "positions": ids}, state)
        assert torch.equal(merged, ids.float())
        found[length] = [
            [r.layer, r.ubatch, str(r.expected), str(r.logical), str(r.physical)]
            for r in stack.classify(raw)
            if not leaders[r.layer]
        ]
print("PROBE " + json.dumps({"reads": found, "counts": dict(dsa_dbo_harness.COUNTS),
      "variants": dsa_dbo_harness.VARIANTS}))
"""
MAX_DECODE_ROWS = 8  # cpu_dbo's: the group's converted state holds 9 rows
LENGTHS = {"decode": (6, 4), "prefill": (20, 12)}
FOLLOWERS = 4


def probe(phase: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env |= {
        "VLLM_DSA_DBO_HARNESS": "1",
        "VLLM_DSA_DBO_HARNESS_GATES": "0",
        "VLLM_DSA_DBO_HARNESS_LOG_EVERY": "1",
        "VLLM_DSA_DBO_DISABLE": "stock" if phase == "stock" else "",
        "VLLM_DSA_DBO_HARNESS_HALF_FIX": "1" if phase == "half_fix" else "",
    }
    result = fresh.python(
        ["-c", PROBE, phase, json.dumps(LENGTHS)], env, cwd=Path(__file__).parent, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(s for s in result.stdout.splitlines() if s.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


def crossed(reads: list, part: int) -> list[tuple[int, int, str]]:
    """Follower reads (layer, microbatch, whose top-k) of `part` (3: logical, 4: converted)
    that are not their own leader's in their own microbatch."""
    return [(r[0], r[1], r[part]) for r in reads if r[part] != r[2]]


def test_prefill_splits_are_longer_than_the_converted_state():
    assert all(n > MAX_DECODE_ROWS + 1 for n in LENGTHS["prefill"])
    assert all(n <= MAX_DECODE_ROWS + 1 for n in LENGTHS["decode"])
    assert sum(LENGTHS["prefill"]) <= 32  # cpu_dbo's max_num_batched_tokens


@pytest.mark.parametrize("phase", ["stock", "half_fix", "fix"])
def test_v2_ubatch_runner_step(phase):
    """Per phase, which followers read another microbatch's top-k, at each length; and the
    harness counting the step as one eager microbatched forward of Model Runner V2."""
    found = probe(phase)
    reads = found["reads"]
    assert all(len(r) == 2 * FOLLOWERS for r in reads.values())
    counts = found["counts"]
    assert counts["eager_steps"] == counts["ubatched_calls"] == len(LENGTHS)
    assert counts["ubatch0_forwards"] == counts["ubatch1_forwards"] == len(LENGTHS)
    assert [v.split(":")[0] for v in found["variants"]] == (
        ["half_fix"] if phase == "half_fix" else []
    )
    logical = {n: crossed(r, 3) for n, r in reads.items()}
    converted = {n: crossed(r, 4) for n, r in reads.items()}
    if phase == "fix":
        assert logical == converted == {"decode": [], "prefill": []}
        return
    # Microbatch 0's followers read microbatch 1's logical top-k: its leader wrote it last.
    for found_logical in logical.values():
        assert {(u, source.split(",")[0]) for _, u, source in found_logical} == {
            (0, "microbatch 1")
        }, found_logical
    assert len(converted["prefill"]) == FOLLOWERS, converted
    if phase == "half_fix":
        # Decode: the followers attend over their microbatch's converted state, which the
        # logical buffer does not feed; prefill: each converts the other's logical top-k.
        assert converted["decode"] == []
        assert {s for *_, s in converted["prefill"]} == {"None"}, converted
    else:
        assert len(converted["decode"]) == FOLLOWERS, converted
