"""The package's import contracts (`[tool.importlinter]` in pyproject.toml) hold: the
commands, then diagnostics, then the guard, then patches, then the core, then settings,
each importing only from below; no cycle between sibling modules; no patch importing
another."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_hold():
    # In its own process: import-linter's logging setup disables every logger that exists,
    # the plugin's included, for the rest of the process that runs it.
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [lint, str(PYPROJECT), "--no-cache"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout
