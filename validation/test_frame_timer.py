"""The harness's frame timer on CPU: the product's own Python time in a forward, whose
microbatch threads vLLM starts inside the timed call."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import dsa_dbo_harness
from dsa_dbo_harness import FrameTimer, _product_dir, hook_costs

OURS = """
import time

def calls_back(fn):
    return fn()

def sleeps(seconds):
    time.sleep(seconds)

def makes_calls(fn):
    len(())
    len(())
    len(())
    fn()
    fn()

def c_calls(n):
    for _ in range(n):
        len(())
"""


TICK = 1e-6


class Clock:
    """`perf_counter` that advances one tick per reading, and by what `sleep` was given.

    Each hook event reads it once, so the timer's own cost is an exact count of
    ticks: the readings are values, not timings of this (possibly loaded) machine.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self.sleep = self.slept.append  # a C call, as time.sleep is

    def perf_counter(self) -> float:
        self.now += TICK + sum(self.slept)
        self.slept.clear()
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(dsa_dbo_harness, "time", fake)
    return fake


def load(path: Path, clock: Clock | None = None) -> dict:
    """OURS's functions, as if defined in the file at `path` (sleeping on `clock`)."""
    namespace: dict = {}
    exec(compile(OURS, str(path), "exec"), namespace)
    if clock is not None:
        namespace["time"] = clock
    return namespace


def test_counts_frames_of_threads_started_while_installed(clock):
    from vllm_dsa_dbo.core import current_ubatch_id

    timer = FrameTimer(_product_dir())

    def microbatch():
        for _ in range(100):
            current_ubatch_id()

    with timer.installed():
        thread = threading.Thread(target=microbatch)
        thread.start()
        thread.join()
        for _ in range(50):
            current_ubatch_id()
    assert timer.calls == 150
    assert timer.self_s > 0


def test_c_calls_count_to_the_frame_python_callees_do_not(tmp_path, clock):
    ours = load(tmp_path / "ours" / "ours.py", clock)
    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["sleeps"](0.05)
    assert timer.calls == 1 and timer.self_s == pytest.approx(0.05 + 3 * TICK)

    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["calls_back"](lambda: clock.sleep(0.05))
    assert timer.calls == 1 and timer.self_s == pytest.approx(2 * TICK)


def test_counts_the_calls_each_function_makes(tmp_path):
    ours = load(tmp_path / "ours" / "ours.py")
    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["makes_calls"](lambda: None)
    (row,) = timer.busiest(5)
    assert (row["function"], row["calls"], row["c_calls"], row["py_calls"]) == (
        "ours.py:makes_calls",
        1,
        3,
        2,
    )


def test_correction_takes_off_the_hook_not_the_work(tmp_path, clock):
    """Under a clock that every hook event advances, a frame of many C calls
    corrects to nothing, and a sleeping frame to its sleep."""
    ours = load(tmp_path / "ours" / "ours.py", clock)
    costs = hook_costs(100)
    assert costs == pytest.approx({"frame": TICK, "c_call": 2 * TICK, "py_call": TICK})
    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["c_calls"](1_000)
    assert timer.self_s == pytest.approx(2_001 * TICK)
    assert timer.corrected_s(costs) == pytest.approx(0.0, abs=1e-12)

    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["sleeps"](0.05)
    assert timer.corrected_s(costs) == pytest.approx(0.05)
