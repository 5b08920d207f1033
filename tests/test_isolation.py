"""The microbatch isolation checker: silent with the fix, exact on stock vLLM."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

import fresh
from test_cli import run_here


def demo(phase: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return fresh.python(["-m", "vllm_dsa_dbo.demo", "--phase", phase], {**environ, **env})


def test_audit_on_stock_vllm_reports_exactly_microbatch0_followers_after_a_yield():
    from vllm_dsa_dbo.cli import DEMO_CROSSED

    result = demo("stock", VLLM_DSA_DBO_DISABLE="stock", VLLM_DSA_DBO_CHECK="audit")
    assert result.returncode == DEMO_CROSSED, result.stderr[-3000:]
    pairs = re.findall(
        r"  (.+?): (group \d follower \d) read (group \d leader)'s write", result.stdout
    )
    readers = sorted({reader for _, reader, _ in pairs})
    # Layers 4 and 5 follow leader 2 (group 2), layer 7 leader 6 (group 3);
    # layer 3 runs before the first yield and reads its own microbatch's.
    assert readers == ["group 2 follower 2", "group 2 follower 3", "group 3 follower 1"]
    kinds = {kind for kind, _, _ in pairs}
    assert kinds == {"logical top-k", "physical top-k", "valid counts", "physical-ready event"}
    assert "isolation checker (audit): 12 violations" in result.stdout
    assert "microbatch isolation violated" in result.stderr + result.stdout


def test_raise_mode_stops_at_the_first_bad_read_on_stock_vllm():
    from vllm_dsa_dbo.cli import DEMO_CROSSED

    result = demo("stock", VLLM_DSA_DBO_DISABLE="stock", VLLM_DSA_DBO_CHECK="raise")
    assert result.returncode == DEMO_CROSSED, result.stderr[-3000:]
    last = result.stdout.splitlines()[-1]
    assert "isolation checker (raise) stopped the step at the first bad read" in last
    assert "group 2 follower 2 in microbatch 0" in last
    assert "top-k reads came from the wrong microbatch" not in result.stdout


def test_fix_gives_zero_violations(undo_patches):
    """In this process, where the plugin is applied; the checker's patches undone after."""
    from vllm_dsa_dbo import demo as phases

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env |= {"VLLM_DSA_DBO_CHECK": "raise"}
    with undo_patches():
        result = run_here(phases.main, ["--phase", "fixed"], env)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(
        r"isolation checker \(raise\): (\d+) violations in (\d+) checked reads", result.stdout
    )
    assert match and match[1] == "0" and int(match[2]) >= 16


def test_off_by_default_installs_nothing(vllm_env):
    from vllm.v1.attention.backends.mla import index_group

    from vllm_dsa_dbo.diagnostics import isolation

    assert isolation.CHECKER is None
    assert index_group.SparseMLAIndexGroup._convert_once.__module__ == index_group.__name__


def test_bad_mode_is_refused():
    from vllm_dsa_dbo.diagnostics.isolation import IsolationChecker

    with pytest.raises(ValueError, match="VLLM_DSA_DBO_CHECK must be one of"):
        IsolationChecker("loud")


def test_a_read_outside_a_forward_is_not_a_hand_off(vllm_env):
    from vllm.forward_context import ForwardContext, override_forward_context

    from vllm_dsa_dbo.diagnostics.isolation import IsolationChecker

    checker = IsolationChecker("audit")
    buffer = object()
    with override_forward_context(ForwardContext({}, {}, {})):
        checker.write("group 1 leader", buffer)
    # FlashInfer SM90's metadata builder reads the follower's buffer for its shape.
    with override_forward_context(None):
        checker.read("group 0 follower 1", "logical top-k", buffer)
    assert (checker.checked_reads, sum(checker.violations.values())) == (0, 0)
    with override_forward_context(ForwardContext({}, {}, {})):
        checker.read("group 0 follower 1", "logical top-k", buffer)
    assert checker.violations == {("group 1 leader", "group 0 follower 1", "logical top-k"): 1}
