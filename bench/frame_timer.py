"""The harness's frame timer on the real clock: what its hook adds per frame and per
call (`hook_costs`), and how much of two frames' read self time the correction
keeps: one of 20,000 trivial C calls (nearly all hook) and one 50 ms sleep (no hook).

    PYTHONPATH=validation python bench/frame_timer.py
"""

from __future__ import annotations

import time

from dsa_dbo_harness import FrameTimer, hook_costs


def c_calls(n: int) -> None:
    for _ in range(n):
        len(())


def main() -> None:
    costs = hook_costs()
    print("hook cost per event (ns):", {k: round(v * 1e9) for k, v in costs.items()})
    frames = {"20,000 C calls": lambda: c_calls(20_000), "sleep 50 ms": lambda: time.sleep(0.05)}
    for label, frame in frames.items():
        timer = FrameTimer(__file__)
        with timer.installed():
            frame()
        read, corrected = timer.self_s * 1e3, timer.corrected_s(costs) * 1e3
        print(f"{label}: read {read:.3f} ms, corrected {corrected:.3f} ms")


if __name__ == "__main__":
    main()
