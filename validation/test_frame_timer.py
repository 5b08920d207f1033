"""The harness's frame timer on CPU: the product's own Python time in a forward, whose
microbatch threads vLLM starts inside the timed call."""

from __future__ import annotations

import threading
import time
from pathlib import Path

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


def load(path: Path) -> dict:
    """OURS's functions, as if defined in the file at `path`."""
    namespace: dict = {}
    exec(compile(OURS, str(path), "exec"), namespace)
    return namespace


def test_counts_frames_of_threads_started_while_installed():
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


def test_c_calls_count_to_the_frame_python_callees_do_not(tmp_path):
    ours = load(tmp_path / "ours" / "ours.py")
    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["sleeps"](0.05)
    assert timer.calls == 1 and timer.self_s >= 0.05

    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["calls_back"](lambda: time.sleep(0.05))
    assert timer.calls == 1 and timer.self_s < 0.01


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


def test_correction_takes_off_the_hook_not_the_work(tmp_path):
    """A frame of many trivial C calls reads mostly hook; a sleeping frame, its sleep."""
    ours = load(tmp_path / "ours" / "ours.py")
    costs = hook_costs(2_000)
    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["c_calls"](20_000)
    assert timer.corrected_s(costs) < 0.5 * timer.self_s

    timer = FrameTimer(str(tmp_path / "ours") + "/")
    with timer.installed():
        ours["sleeps"](0.05)
    assert timer.corrected_s(costs) >= 0.049
