"""The harness's frame timer on CPU: the product's own Python time in a forward, whose
microbatch threads vLLM starts inside the timed call."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from dsa_dbo_harness import FrameTimer, _product_dir

OURS = """
import time

def calls_back(fn):
    return fn()

def sleeps(seconds):
    time.sleep(seconds)
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
