"""serve_table.sh refuses a mode or lane it does not know before it touches the GPU machine."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "serve_table.sh"


@pytest.mark.parametrize(
    ("mode", "lane", "says"),
    [
        ("xx", "0", "mode: ht or ll, not xx"),
        ("ht", "x", "SERVE_TABLE_LANE: a lane number 0-9, not 'x'"),
        ("ll", "12", "SERVE_TABLE_LANE: a lane number 0-9, not '12'"),
    ],
)
def test_bad_mode_or_lane_exits_2_with_a_message(tmp_path, mode, lane, says):
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), mode, "off_a"],
        env={**os.environ, "SERVE_TABLE_LANE": lane},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stdout.strip()) == (2, says)
    assert list(tmp_path.iterdir()) == []
