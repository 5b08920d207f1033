"""The tests' fresh interpreters (tests/fresh.py) behave as fresh interpreters would, and
fork from the server where they can."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fresh

SEEN = "import sys; print(sorted(m for m in ('torch', 'vllm_dsa_dbo') if m in sys.modules))"


def test_runs_fork_from_torch_and_vllm_but_not_the_package():
    result = fresh.python(["-c", SEEN], dict(os.environ))
    assert (result.returncode, result.stdout) == (0, "['torch']\n"), result.stderr


def test_a_run_with_its_own_environment_is_a_real_subprocess():
    result = fresh.python(["-c", SEEN], {**os.environ, "FRESH_TEST_OWN_VARIABLE": "1"})
    assert (result.returncode, result.stdout) == (0, "[]\n"), result.stderr


def run_with_stand_in(root: Path, package: str, code: str) -> subprocess.CompletedProcess:
    """`code` in a run whose PYTHONPATH holds `root`, where `package` prints its folder's name."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(f"print({root.name!r})\n")
    return fresh.python(["-c", code], {**os.environ, "PYTHONPATH": str(root)})


def test_the_package_on_the_runs_pythonpath_is_the_one_imported(tmp_path):
    result = run_with_stand_in(tmp_path / "copy", "vllm_dsa_dbo", "import vllm_dsa_dbo")
    assert (result.returncode, result.stdout) == (0, "copy\n"), result.stderr


def test_a_run_in_a_vllm_tree_imports_its_vllm_and_forks_from_torch(tmp_path):
    code = "import sys, vllm; print('torch' in sys.modules)"
    result = run_with_stand_in(tmp_path / "tree", "vllm", code)
    assert (result.returncode, result.stdout) == (0, "tree\nTrue\n"), result.stderr


def test_argv_cwd_exit_codes_and_tracebacks_are_a_fresh_interpreters(tmp_path):
    env = dict(os.environ)
    code = "import os, sys; print(sys.argv, os.getcwd()); sys.exit(sys.argv[1])"
    result = fresh.python(["-c", code, "bad"], env, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr == "bad\n"
    assert result.stdout == f"['-c', 'bad'] {tmp_path}\n"
    assert fresh.python(["-c", "import sys; sys.exit(3)"], env).returncode == 3
    raised = fresh.python(["-c", "raise KeyError('k')"], env)
    assert raised.returncode == 1 and raised.stderr.endswith("KeyError: 'k'\n")
    usage = fresh.python(["-m", "vllm_dsa_dbo.cli", "--help"], env)
    assert usage.returncode == 0 and "usage: vllm-dsa-dbo" in usage.stdout
    assert usage.args == [sys.executable, "-m", "vllm_dsa_dbo.cli", "--help"]


NESTED = (
    "import os, sys, fresh\n"
    "inner = fresh.python(['-c', 'import os; print(os.getppid())'], dict(os.environ))\n"
    "print(os.getppid(), inner.stdout.strip() or inner.stderr, fresh._server_env is None)\n"
)


def test_a_runs_own_run_forks_from_the_same_server():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(fresh.__file__)}
    result = fresh.python(["-c", NESTED], env)
    assert result.returncode == 0, result.stderr
    outer, inner, started_none = result.stdout.split()
    assert (inner, started_none) == (outer, "True"), result.stdout


def test_a_run_that_times_out_leaves_where_it_was_stuck(capsys):
    stuck = "import threading\ndef stuck_here():\n    threading.Event().wait()\nstuck_here()\n"
    with pytest.raises(subprocess.TimeoutExpired):
        fresh.python(["-c", stuck], dict(os.environ), timeout=5)
    assert 'line 3 in stuck_here\n  File "<string>", line 4 in <module>' in capsys.readouterr().err
