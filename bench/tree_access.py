"""Host cost of reading the top-k state outside DBO: vLLM 0.33.0 and the upstream change.

    python bench/tree_access.py

Unpacks vLLM's sdist twice (tests/upstream_tree.py, the sdist from tests/vllm_sdist.py's
cache), patches one copy with `vllm-dsa-dbo upstream-patch`, and in each tree times, on a
CPU with stand-in events, the reads a sparse MLA layer makes outside any microbatch thread:
the impl's `topk_indices_buffer` and a follower's `convert_logical_to_physical_topk` (it
reads the group's state and waits on its event; the leader converts). `dbo configured`
builds the groups as a model run with DBO does (two microbatches) and reads outside the
microbatch threads, as a step DBO leaves unsplit does. Median of many repeats, ns per read,
the fastest of three alternating rounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))

import upstream_tree  # noqa: E402

ROUNDS = 3

MEASURE = """
import inspect, json, sys
from types import SimpleNamespace
sys.path.insert(0, BENCH)
from cpu_access import ns_per_access  # sets up the CPU run before it imports vLLM
import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder
from vllm_dsa_dbo import cpu_dbo

results = {}
with cpu_dbo.fake_streams():
    for label, kwargs in (("no dbo", {}), ("dbo configured", {"num_ubatches": 2})):
        logical = torch.zeros(8, 128, dtype=torch.int32)
        # vLLM 0.33.0's builder takes no count: it builds the same groups either way.
        takes_count = "num_ubatches" in inspect.signature(SparseMLAIndexGroupBuilder).parameters
        builder = SparseMLAIndexGroupBuilder(logical, 4, **(kwargs if takes_count else {}))
        group, leader = builder.register_layer(True)
        _, follower = builder.register_layer(False)
        impl = SharedTopkIndicesBuffer()
        impl.init_topk_indices_buffer(None, logical)
        impl.index_group = group
        metadata = SimpleNamespace(
            req_id_per_token=torch.zeros(2, dtype=torch.int32),
            block_table=torch.zeros(1, 4, dtype=torch.int32),
            block_size=4,
        )
        group.convert_logical_to_physical_topk(
            leader, logical[:2], metadata, block_stride_rows=None, return_valid_counts=True
        )
        results[f"{label}: impl.topk_indices_buffer"] = ns_per_access(
            lambda: impl.topk_indices_buffer
        )
        results[f"{label}: follower convert_logical_to_physical_topk"] = ns_per_access(
            lambda: group.convert_logical_to_physical_topk(
                follower, logical[:2], metadata, block_stride_rows=None, return_valid_counts=True
            )
        )
print("BENCH " + json.dumps(results))
"""


def measure(root: Path) -> dict[str, float]:
    env = {**upstream_tree.tree_env(root), "VLLM_PLUGINS": ""}
    result = subprocess.run(
        [sys.executable, "-c", f"BENCH = {str(BENCH)!r}\n{MEASURE}"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(line.removeprefix("BENCH "))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        unpatched, patched = upstream_tree.prepare(Path(tmp))
        # Alternating rounds, the fastest of each: a shared machine's load comes and goes.
        rounds = [(measure(unpatched), measure(patched)) for _ in range(ROUNDS)]
    stock = {read: min(r[0][read] for r in rounds) for read in rounds[0][0]}
    changed = {read: min(r[1][read] for r in rounds) for read in rounds[0][1]}
    print(f"{'read (outside microbatch threads)':58s} {'0.33.0 ns':>9s} {'change ns':>9s}")
    for read, ns in stock.items():
        print(f"{read:58s} {ns:9.1f} {changed[read]:9.1f} {changed[read] / ns:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
