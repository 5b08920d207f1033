"""`vllm-dsa-dbo demo`: one DBO step through vLLM's real sparse MLA layers on a
CPU, as the installed vLLM ships (`--phase stock`) or with the fix (`--phase fixed`).

    python -m vllm_dsa_dbo.demo --phase stock|fixed
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version
from typing import TYPE_CHECKING

from vllm_dsa_dbo.cli import DEMO_CROSSED, DEMO_NO_VLLM, vllm_unusable

if TYPE_CHECKING:
    from vllm_dsa_dbo.cpu_dbo import Read


def use_cpu() -> None:
    """Set the environment the CPU runs need; call it before vLLM is imported.

    The logical -> physical conversion is a Triton kernel: it runs interpreted.
    vLLM swaps Triton for a placeholder on a host with no GPU driver unless the
    visible-device list is empty (as under Ray), so that list is emptied.
    """
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def report(reads: list[Read], leaders: list[bool]) -> list[str]:
    lines = []
    for r in reads:
        if leaders[r.layer]:
            continue
        verdict = "ok" if r.ok else "WRONG"
        lines.append(
            f"  layer {r.layer} (follows {r.expected.leader}), microbatch {r.ubatch}: "
            f"logical top-k of {r.logical or 'nobody'}; "
            f"physical top-k of {r.physical or 'nobody'}  [{verdict}]"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase", choices=["stock", "fixed"], required=True)
    args = parser.parse_args(argv)

    use_cpu()
    if unusable := vllm_unusable():
        print(unusable, file=sys.stderr)
        return DEMO_NO_VLLM
    import vllm_dsa_dbo
    from vllm_dsa_dbo import cpu_dbo
    from vllm_dsa_dbo.diagnostics import isolation
    from vllm_dsa_dbo.diagnostics.layout import leader_mask

    leaders = leader_mask(cpu_dbo.GLM5_LAYOUT)
    # As vLLM would: applies the fix unless VLLM_DSA_DBO_DISABLE is set, and
    # the isolation checker when VLLM_DSA_DBO_CHECK is.
    vllm_dsa_dbo.register()
    title = f"vLLM {version('vllm')} as released" if args.phase == "stock" else "with vllm-dsa-dbo"
    print(f"{title}: leaders {[i for i, lead in enumerate(leaders) if lead]}")
    with cpu_dbo.cpu_vllm(), cpu_dbo.fake_streams():
        stack = cpu_dbo.SharedTopkStack(leaders, None if args.phase == "stock" else 2)
        try:
            reads = stack.run_step(yield_from_layer=cpu_dbo.FIRST_MOE_LAYER)
        except isolation.MicrobatchIsolationError as e:
            print(f"{title}: isolation checker (raise) stopped the step at the first bad read: {e}")
            return DEMO_CROSSED
    wrong = [r for r in reads if not r.ok]
    print("\n".join(report(reads, leaders)))
    print(f"{title}: {len(wrong)} of {len(reads)} top-k reads came from the wrong microbatch")
    checker = isolation.CHECKER
    if checker is not None:
        print(
            f"{title}: isolation checker ({checker.mode}): {sum(checker.violations.values())} "
            f"violations in {checker.checked_reads} checked reads"
        )
        for (writer, reader, kind), count in sorted(checker.violations.items()):
            print(f"  {kind}: {reader} read {writer}'s write from the other microbatch ({count}x)")
    return DEMO_CROSSED if wrong or (checker is not None and checker.violations) else 0


if __name__ == "__main__":
    sys.exit(main())
