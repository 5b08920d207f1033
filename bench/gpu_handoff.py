"""On a GPU: the fix adds no host syncs and no kernels to the top-k hand-off,
and allocates exactly the formula's bytes at GLM-5.3 geometry.

    python bench/gpu_handoff.py [--json OUT.json]

Runs itself twice in subprocesses, stock vLLM (VLLM_DSA_DBO_DISABLE=stock) and
with the fix. Each runs one DBO step (leader 0, leader 1, then followers)
through vLLM's real index groups, sparse MLA impls, microbatch threads, CUDA
streams and events and the Triton conversion kernel, for GLM-5's 8-layer
layout, under `torch.cuda.set_sync_debug_mode("error")` and the torch
profiler; it checks every read against what its own leader wrote. The fixed
run also builds a GLM-5.3-sized builder (78 layers, index_topk 2048,
8192 batched tokens, 1024 decode rows) and measures the extra device memory.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--phase" in sys.argv:
    # Real Triton kernels on the real GPU (the CPU demo sets the opposite).
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402


def measure_phase(phase: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import vllm_dsa_dbo
    from vllm_dsa_dbo import cpu_dbo
    from vllm_dsa_dbo.cpu_dbo import FIRST_MOE_LAYER, GLM5_LAYOUT, SharedTopkStack
    from vllm_dsa_dbo.diagnostics.layout import leader_mask

    vllm_dsa_dbo.register()
    result: dict = {"phase": phase, "gpu": torch.cuda.get_device_name(0)}
    if phase == "fixed":
        # First, before anything else lives on the device.
        result["glm53"] = {freq: glm53_extra_bytes(freq) for freq in (4, 1)}
    with cpu_dbo.cpu_vllm():
        stream = torch.cuda.Stream()
        stack = SharedTopkStack(
            leader_mask(GLM5_LAYOUT), None if phase == "stock" else 2, device="cuda"
        )
        stack.run_reads(FIRST_MOE_LAYER, stream)  # warm up Triton's compilation
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.set_sync_debug_mode("error")
            try:
                raw = stack.run_reads(FIRST_MOE_LAYER, stream)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        reads = stack.classify(raw)
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        result.update(
            host_syncs=0,  # any sync in the step would have raised above
            cuda_kernels_per_step=len(kernels),
            wrong_reads=[(r.layer, r.ubatch) for r in reads if not r.ok],
            reads=len(reads),
        )
    return result


def glm53_extra_bytes(index_topk_freq: int) -> dict:
    """Device memory a GLM-5.3-sized builder allocates with 2 microbatches
    beyond what it allocates with 1, and the bytes of the tensors it made."""
    import torch
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    from vllm_dsa_dbo.cli import GLM53
    from vllm_dsa_dbo.diagnostics.layout import leader_mask
    from vllm_dsa_dbo.diagnostics.startup import ubatch_topk_bytes

    leaders = leader_mask({**GLM53, "index_topk_freq": index_topk_freq})
    allocated, builders = {}, {}
    gc.collect()
    gc.disable()  # nothing else may free device memory while we count
    try:
        for num_ubatches in (1, 2):
            buffer = torch.empty(8192, GLM53["index_topk"], dtype=torch.int32, device="cuda")
            before = torch.cuda.memory_allocated()
            builder = SparseMLAIndexGroupBuilder(buffer, 1024, num_ubatches=num_ubatches)
            # Kept alive as the model's impls keep them: a group the builder
            # moved past is otherwise freed, with its stock physical rows.
            groups = [builder.register_layer(leads)[0] for leads in leaders]
            allocated[num_ubatches] = torch.cuda.memory_allocated() - before
            builders[num_ubatches] = builder, groups
    finally:
        gc.enable()
    return {
        "groups_with_followers": len(builders[2][0].follower_groups),
        "allocator_bytes": allocated,
        "allocator_extra_bytes": allocated[2] - allocated[1],
        "tensor_extra_bytes": ubatch_topk_bytes(builders[2][0].follower_groups),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase", choices=["stock", "fixed"])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.phase:
        print("RESULT " + json.dumps(measure_phase(args.phase)))
        return 0
    return run_phases(__file__, args.json)


def run_phases(script: str, json_path: str | None, extra: tuple[str, ...] = ()) -> int:
    """Run `script --phase` stock (VLLM_DSA_DBO_DISABLE=stock), then fixed, each in
    its own interpreter with `extra` arguments; print their RESULT lines as one
    record, saved to `json_path`."""
    results = {}
    for phase, disable in (("stock", "stock"), ("fixed", "")):
        env = {**os.environ, "VLLM_DSA_DBO_DISABLE": disable}
        out = subprocess.run(
            [sys.executable, script, "--phase", phase, *extra],
            env=env,
            capture_output=True,
            text=True,
        )
        line = next((r for r in out.stdout.splitlines() if r.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            sys.stderr.write(out.stdout[-3000:] + out.stderr[-6000:])
            return 1
        results[phase] = json.loads(line[len("RESULT ") :])
    import torch
    import vllm

    record = {
        "command": " ".join(sys.argv),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **results,
    }
    print(json.dumps(record, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
