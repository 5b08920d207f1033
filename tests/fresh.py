"""`python ARGS` as a fresh interpreter runs it, for the tests that need one.

Most of such a run goes to importing torch and vLLM: it is forked by multiprocessing's
forkserver from a server that imported them once (`PRELOAD`; never this package, so the run
imports the copy its PYTHONPATH names). A run whose PYTHONPATH names a vLLM source tree forks
from a second server that imported only what vLLM imports (`THIRD_PARTY`), so that it imports
the tree's vLLM; multiprocessing keeps one server per process, so a spawned worker holds it.
A run whose environment differs from the server's in more than what is read only when used
(`LAZY`) runs as a real subprocess. A run's own runs (a test of a subprocess, run on a mutated
copy) are asked of the process that started it, so that one server serves them all.
"""

from __future__ import annotations

import concurrent.futures
import faulthandler
import gc
import importlib
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# What importing vLLM imports that takes longest, none of it vLLM's: what a run in a vLLM tree
# imports first. A module missing here costs only time.
THIRD_PARTY = [
    "cutlass",
    "flashinfer.decode",
    "pytest",
    "torch",
    "torch._inductor.lowering",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.processing_utils",
]
# What every other run imports first; none of either list imports the package under test or
# starts a thread.
PRELOAD = [
    *THIRD_PARTY,
    "vllm.config",
    "vllm.distributed",
    "vllm.forward_context",
    "vllm.model_executor.layers.attention.sparse_mla_attention",
    "vllm.model_executor.model_loader",
    "vllm.plugins",
    "vllm.utils.b12x",  # CUTLASS's DSL: about half of what registering imports
    "vllm.utils.torch_utils",
    "vllm.v1.attention.backends.mla.index_group",
    "vllm.v1.worker.ubatching",
]
# Set in the worker that holds the tree server, and so in that server and its runs.
TREES = "TESTS_FRESH_TREES"
# Read only when used: by the import system, pytest, vLLM's plugin loader, the package, and
# Humming's kernel builds (none of PRELOAD imports Humming).
LAZY = (
    "PYTHONPATH",
    "PYTEST_CURRENT_TEST",
    "VLLM_PLUGINS",
    "VLLM_DSA_DBO_",
    "HUMMING_DISABLE_PARALLEL_BUILD",
    TREES,
)

# Here too (not in the tree worker or its server, which must not import vLLM): importing some
# of it sets variables, which the server's environment then has. A server imports this module
# last: its preloaded heap is then out of the collector's sight, in every run (pytest collects
# at exit; a run would walk all of torch's and vLLM's objects).
if multiprocessing.parent_process() is None and TREES not in os.environ:
    for _name in PRELOAD:
        importlib.import_module(_name)
gc.freeze()

_server_env: dict[str, str] | None = None
# In a run: the connection its own runs are asked for on, to the process that started it.
_starter: multiprocessing.connection.Connection | None = None
_starter_lock = threading.Lock()
_trees: concurrent.futures.ProcessPoolExecutor | None = None
_trees_lock = threading.Lock()


def _fixed(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(LAZY)}


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context; its server starts in this process's environment."""
    global _server_env
    context = multiprocessing.get_context("forkserver")
    if _server_env is None:
        _server_env = _fixed(dict(os.environ))
        preload = THIRD_PARTY if TREES in os.environ else PRELOAD
        context.set_forkserver_preload([*preload, __name__])
    return context


def _in_tree(env: dict[str, str]) -> bool:
    """Whether the run imports vLLM from a source tree on its PYTHONPATH."""
    path = env.get("PYTHONPATH", "").split(os.pathsep)
    return TREES not in os.environ and any(p and Path(p, "vllm").is_dir() for p in path)


def _tree_worker() -> concurrent.futures.ProcessPoolExecutor:
    """The spawned worker that holds the tree server, in this process's environment."""
    global _trees
    with _trees_lock:
        if _trees is None:
            _trees = concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("spawn"))
            _trees.submit(_hold_trees, dict(os.environ)).result()
    return _trees


def _hold_trees(env: dict[str, str]) -> None:
    # Clears too what was set outside os.environ (COLUMNS, LINES), which the spawn passed on.
    os.environ.clear()
    os.environ.update(env, **{TREES: "1"})


def exit_code(code: object) -> int:
    """What the interpreter exits with for `sys.exit(code)`."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _run(args: list[str], env: dict[str, str], cwd: str, out: str, err: str, starter) -> None:
    """In the forked child: `python ARGS` as a fresh interpreter would run it."""
    global _starter
    _starter = starter
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY)
        os.dup2(opened, fd)
        os.close(opened)
    faulthandler.enable()  # a run that times out is aborted: where it was stuck, in its stderr
    flag, target, *rest = args
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [cwd if flag == "-m" else "", *pythonpath]
    try:
        if flag == "-m":
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        rc = 0
    except SystemExit as e:
        rc = exit_code(e.code)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the run's code on
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def python(
    args: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float | None = 600
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`,
    for `args` starting with `-m` or `-c`."""
    where = str(cwd or os.getcwd())
    if _starter is not None:
        with _starter_lock:
            _starter.send((args, env, where, timeout))
            answer = _starter.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer
    if _in_tree(env):
        return _tree_worker().submit(python, args, env, cwd, timeout).result()
    command = [sys.executable, *args]
    context = _context()
    if _fixed(env) != _server_env:
        return subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        here, there = context.Pipe()
        process = context.Process(target=_run, args=(args, env, where, str(out), str(err), there))
        process.start()
        there.close()
        try:
            _serve(process, here, timeout, command)
        except subprocess.TimeoutExpired:
            sys.stderr.write(err.read_text(errors="replace")[-20_000:])
            raise
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    return subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)


def _serve(process, connection, timeout: float | None, command: list[str]) -> None:
    """Wait for `process`, running the runs it asks for on `connection` meanwhile."""
    waiting = [process.sentinel, connection]
    deadline = None if timeout is None else time.monotonic() + timeout
    while process.exitcode is None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(waiting, left)
        if not ready:
            os.kill(process.pid, signal.SIGABRT)
            process.join(30)
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(command, timeout)
        if connection in ready:
            try:
                request = connection.recv()
            except EOFError:
                waiting.remove(connection)
                continue
            try:
                answer = python(*request[:2], Path(request[2]), request[3])
            except Exception as e:
                answer = e
            connection.send(answer)
        process.join(0)
    connection.close()
