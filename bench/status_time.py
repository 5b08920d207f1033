"""`vllm-dsa-dbo status` against `python -c "import vllm"`, side by side.

    python bench/status_time.py [--repeats N]

Each repeat runs the commands in turn, so a load that comes and goes hits all of them; the
wall time of each run is to process exit. Prints the medians and status's ratio to vLLM's
import (the aim: at most 1.5), and `status --check` (which imports vLLM's model code) beside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c 'import vllm'": ["-c", "import vllm"],
    "vllm-dsa-dbo status": ["-m", "vllm_dsa_dbo.cli", "status"],
    "vllm-dsa-dbo status --check": ["-m", "vllm_dsa_dbo.cli", "status", "--check"],
}


def seconds(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(repeats):
        for name, args in COMMANDS.items():
            times[name].append(seconds(args, env))
    medians = {name: statistics.median(runs) for name, runs in times.items()}
    for name, runs in times.items():
        shown = " ".join(f"{t:.1f}" for t in runs)
        print(f"{name:<30} median {medians[name]:5.1f} s  (runs: {shown})")
    base, status = medians["python -c 'import vllm'"], medians["vllm-dsa-dbo status"]
    print(f"status / import vllm: {status / base:.2f} (aim: at most 1.5)")
    print(f"status --check / import vllm: {medians['vllm-dsa-dbo status --check'] / base:.2f}")


if __name__ == "__main__":
    main()
