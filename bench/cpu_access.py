"""Per-access cost of the top-k state resolution, stock vLLM vs the fix.

    python bench/cpu_access.py [--json OUT.json]

One process: vLLM's stock classes are timed first, then the fix is applied and
the same accesses are timed again, outside any microbatch thread and inside
vLLM's microbatch threads (microbatch 0 and 1). Median of many repeats, in
nanoseconds per access.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from vllm_dsa_dbo.demo import use_cpu

use_cpu()  # before vLLM is imported

import torch  # noqa: E402
import vllm  # noqa: E402

from vllm_dsa_dbo import cpu_dbo  # noqa: E402

ACCESSES = 20_000
REPEATS = 41


def ns_per_access(read) -> float:
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter_ns()
        for _ in range(ACCESSES):
            read()
        samples.append((time.perf_counter_ns() - start) / ACCESSES)
    return statistics.median(samples)


# DBO's own microbatch lookup, timed alongside for scale: "one dict read per
# access" means a stock read plus about this.
UBATCH_ID_LOOKUP = "dbo_current_ubatch_id()"


def measure(stack) -> dict[str, float]:
    from vllm.v1.worker.ubatching import dbo_current_ubatch_id

    follower, group = stack.impls[2], stack.impls[2].index_group
    return {
        UBATCH_ID_LOOKUP: ns_per_access(dbo_current_ubatch_id),
        "impl.topk_indices_buffer (follower)": ns_per_access(lambda: follower.topk_indices_buffer),
        "attention.topk_indices_buffer (leader writer)": ns_per_access(
            lambda: stack.attns[1].topk_indices_buffer
        ),
        # Every read of the group's state resolves the microbatch's copy.
        "group.physical_topk_indices": ns_per_access(lambda: group.physical_topk_indices),
    }


def measure_everywhere(num_ubatches: int | None) -> dict[str, dict[str, float]]:
    from vllm_dsa_dbo.cpu_dbo import SharedTopkStack

    stack = SharedTopkStack([True, True, False], num_ubatches)
    results = {"outside microbatch threads": measure(stack)}

    def step(ubatch: int) -> None:
        results[f"inside microbatch {ubatch}"] = measure(stack)

    cpu_dbo.run_dbo_step(step)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import vllm_dsa_dbo.patches as patches

    with cpu_dbo.cpu_vllm(), cpu_dbo.fake_streams():
        stock = measure_everywhere(None)
        patches.apply_all(patches.fix_patches())
        fixed = measure_everywhere(2)
    rows = []
    print(
        f"{'where':28s} {'access':46s} {'stock ns':>9s} {'fix ns':>9s} {'ratio':>6s} "
        f"{'stock + lookup ns':>18s} {'ratio':>6s}"
    )
    for where, accesses in stock.items():
        lookup_ns = accesses.pop(UBATCH_ID_LOOKUP)
        print(f"{where:28s} {UBATCH_ID_LOOKUP:46s} {lookup_ns:9.1f}")
        for access, stock_ns in accesses.items():
            fix_ns = fixed[where][access]
            with_lookup = stock_ns + lookup_ns
            rows.append(
                {
                    "where": where,
                    "access": access,
                    "stock_ns": stock_ns,
                    "fix_ns": fix_ns,
                    "ratio": fix_ns / stock_ns,
                    "ubatch_id_lookup_ns": lookup_ns,
                    "stock_plus_lookup_ns": with_lookup,
                    "ratio_to_stock_plus_lookup": fix_ns / with_lookup,
                }
            )
            print(
                f"{where:28s} {access:46s} {stock_ns:9.1f} {fix_ns:9.1f} {fix_ns / stock_ns:6.2f} "
                f"{with_lookup:18.1f} {fix_ns / with_lookup:6.2f}"
            )
    if args.json:
        record = {
            "command": " ".join(sys.argv),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "accesses_per_repeat": ACCESSES,
            "repeats": REPEATS,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
