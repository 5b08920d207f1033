"""The package's import contracts (`[tool.importlinter]` in pyproject.toml) hold: the
commands, then diagnostics, then the guard, then patches, then the core, then settings,
each importing only from below; no cycle between sibling modules; no patch importing
another."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_hold(capsys):
    assert lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True) == 0, (
        capsys.readouterr().out
    )
