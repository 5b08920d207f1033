"""Each command beside no vLLM, a vLLM that does not import, or no `packaging`: one line
saying what to install, never a traceback; what needs no vLLM (`ab`) works there."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import bare_python

INSTALL = (
    "install vLLM 0.33.0 or 0.34.0 beside the plugin, as README.md's Install says "
    "(pip install vllm==0.33.0, or vLLM 0.34.0's container image)"
)
NO_VLLM = f"vLLM is not installed: {INSTALL}"
NO_TORCH = f"vLLM {version('vllm')} does not import (ModuleNotFoundError: No module named 'torch')"
NO_PACKAGING = (
    "the Python package packaging, which vllm-dsa-dbo requires, is not installed (was the "
    "plugin installed with --no-deps?): pip install packaging"
)
SERVED = Path(__file__).resolve().parents[1] / "validation/results/2026-11-30-two-gpu-serve"
RUN_VLLM = [["memory", "--preset", "glm-5.3"], ["demo"]]
EVERY = [["status"], ["status", "--check"], *RUN_VLLM, ["ab", "a", "b"], ["upstream-patch", "."]]


@pytest.fixture(scope="module")
def no_vllm(tmp_path_factory) -> Path:
    return bare_python.python(tmp_path_factory.mktemp("no-vllm"))


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> Path:
    """vLLM's files, none of what it requires: torch is what `import vllm` misses first."""
    return bare_python.python(tmp_path_factory.mktemp("no-torch"), vllm=True)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a failing command wrote, to stderr, with nothing on stdout."""
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    return line


@pytest.mark.parametrize("args", RUN_VLLM, ids=" ".join)
def test_commands_that_run_vllm_say_it_is_not_installed(no_vllm, args):
    assert error_line(bare_python.run(no_vllm, *args)) == f"error: {NO_VLLM}"


@pytest.mark.parametrize("args", RUN_VLLM, ids=" ".join)
def test_commands_that_run_vllm_say_it_does_not_import(no_torch, args):
    assert error_line(bare_python.run(no_torch, *args)) == f"error: {NO_TORCH}: {INSTALL}"


@pytest.mark.parametrize("check", [[], ["--check"]], ids=["status", "status --check"])
def test_status_without_vllm(no_vllm, check):
    result = bare_python.run(no_vllm, "status", *check)
    assert result.returncode == 1 and result.stderr == "", result.stdout + result.stderr
    assert "vLLM: not installed (supported: 0.33.0 and 0.34.0)\n" in result.stdout
    assert result.stdout.splitlines()[-1] == f"fix NOT active: {NO_VLLM}"


@pytest.mark.parametrize("check", [[], ["--check"]], ids=["status", "status --check"])
def test_status_beside_a_vllm_that_does_not_import(no_torch, check):
    result = bare_python.run(no_torch, "status", *check)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "vLLM: does NOT import (supported: 0.33.0 and 0.34.0)\n" in result.stdout
    assert result.stdout.splitlines()[-1] == f"fix NOT active: {NO_TORCH}: {INSTALL}"


def test_ab_needs_no_vllm(no_vllm):
    runs = [str(SERVED / name) for name in ("off_a", "on_stock", "on_fix")]
    args = ["ab", *runs, "--task", "gsm8k_local"]
    here = subprocess.run(
        [sys.executable, "-m", "vllm_dsa_dbo", *args], capture_output=True, text=True
    )
    there = bare_python.run(no_vllm, *args)
    assert there.returncode == here.returncode == 0, there.stderr
    assert there.stdout == here.stdout and "on_stock" in there.stdout


@pytest.mark.parametrize("args", EVERY, ids=" ".join)
def test_every_command_without_packaging(tmp_path, args):
    """The plugin installed with --no-deps where nothing else brought `packaging`."""
    result = bare_python.run(bare_python.python(tmp_path, packaging=False), *args)
    if args[0] == "status":
        assert result.returncode == 1 and result.stderr == "", result.stderr
        assert result.stdout == f"fix NOT active: {NO_PACKAGING}\n"
    else:
        assert error_line(result) == f"error: {NO_PACKAGING}"


def test_version_names_the_releases(no_vllm):
    result = bare_python.run(no_vllm, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"vllm-dsa-dbo {version('vllm-dsa-dbo')} (for vLLM 0.33.0 and 0.34.0)\n"
