"""`python ARGS` runs forked from one interpreter that imported torch and vLLM once.

Most of a short `python -m pytest TEST` or `python -m vllm_dsa_dbo.cli` run goes to importing
torch and vLLM. A server imports them, never this package, and forks a child per run; the child
takes the run's environment, working directory, argv and sys.path (its PYTHONPATH first, as a
fresh interpreter's), so the package it imports is the run's own copy. The server imports in
the environment of its runs, less the variables read only when used (`lazy`): where this
process's environment has changed since (imports set some), a new server replaces it; a run
with an environment of its own (not this process's) runs as a real subprocess.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import types
from concurrent.futures import Future
from pathlib import Path

# Heavy imports of every run; none imports the package under test.
PRELOAD = (
    "pytest",
    "torch",
    "vllm.config",
    "vllm.distributed",
    "vllm.forward_context",
    "vllm.model_executor.layers.attention.sparse_mla_attention",
    "vllm.model_executor.model_loader",
    "vllm.plugins",
    "vllm.utils.torch_utils",
    "vllm.v1.attention.backends.mla.index_group",
    "vllm.v1.worker.ubatching",
)
PACKAGE = "vllm_dsa_dbo"


def lazy(name: str) -> bool:
    """Read only when used: by the import system, pytest, vLLM's plugin loader, the package."""
    return name in ("PYTHONPATH", "PYTEST_CURRENT_TEST", "VLLM_PLUGINS") or name.startswith(
        "VLLM_DSA_DBO_"
    )


def fixed(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not lazy(k)}


def _send(fd: int, message: dict) -> None:
    # One short write: atomic on a pipe, so concurrent monitors never interleave.
    os.write(fd, (json.dumps(message) + "\n").encode())


def _exit_code(code: object) -> int:
    """What the interpreter exits with for `sys.exit(code)`."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _main(args: list[str], cwd: str, pythonpath: list[str]) -> int:
    """`python -m MODULE ...` or `python -c CODE ...` in this interpreter."""
    flag, target, *rest = args
    try:
        if flag == "-m":
            sys.path[:1] = [cwd, *pythonpath]
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[:1] = ["", *pythonpath]
            sys.argv = ["-c", *rest]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException as e:
        sys.excepthook(type(e), e, e.__traceback__.tb_next)  # from the run's code on
        return 1
    return 0


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags)
    os.dup2(opened, fd)
    os.close(opened)


def _child(request: dict, out: int) -> None:
    os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _redirect(0, os.devnull, os.O_RDONLY)
    sys.stdin = open(os.devnull)  # the server's buffered stdin may hold later requests
    for fd, name in ((1, "stdout"), (2, "stderr")):
        _redirect(fd, request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    rc = 1
    try:
        pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        rc = _main(request["args"], request["cwd"], pythonpath)
        threading._shutdown()  # as the interpreter exits: non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _monitor(request: dict, out: int) -> None:
    """Forks the run, reports its pid, then its exit code (negative: the signal that ended it)."""
    try:
        pid = os.fork()
        if pid == 0:
            _child(request, out)
        _send(out, {"id": request["id"], "pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(out, {"id": request["id"], "rc": os.waitstatus_to_exitcode(status)})
    finally:
        os._exit(0)


def serve() -> None:
    """Reads one JSON request a line from stdin until EOF and answers on stdout."""
    for name in PRELOAD:
        importlib.import_module(name)
    if PACKAGE in sys.modules:
        raise RuntimeError(f"preloading imported {PACKAGE}: every run would share it")
    if threading.active_count() > 1:
        raise RuntimeError("preloading started a thread: forking could deadlock the runs")
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.dup(1)
    _redirect(1, os.devnull, os.O_WRONLY)
    _send(out, {"ready": True})
    monitors = set()
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            _monitor(json.loads(line), out)
        monitors.add(pid)
        while monitors and (done := os.waitpid(-1, os.WNOHANG)[0]):
            monitors.discard(done)
    for pid in monitors:
        os.waitpid(pid, 0)


class ForkServer:
    """The server's client: `run` is thread-safe and runs proceed in parallel."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = fixed(env)
        self._process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            text=True,
        )
        self._lock = threading.Lock()
        self._next_id = 0
        self._pids: dict[int, Future] = {}
        self._codes: dict[int, Future] = {}
        if not self._process.stdout.readline():
            raise RuntimeError(f"fork server exited with {self._process.wait()} before ready")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            message = json.loads(line)
            futures = self._pids if "pid" in message else self._codes
            futures.pop(message["id"]).set_result(message.get("pid", message.get("rc")))
        for future in [*self._pids.values(), *self._codes.values()]:
            future.set_exception(RuntimeError("fork server exited"))

    def run(
        self, args: list[str], cwd: str, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            stdout, stderr = Path(tmp) / "stdout", Path(tmp) / "stderr"
            with self._lock:
                run_id = self._next_id
                self._next_id += 1
                pid, code = Future(), Future()
                self._pids[run_id], self._codes[run_id] = pid, code
                request = {"id": run_id, "args": args, "cwd": cwd, "env": env}
                request.update(stdout=str(stdout), stderr=str(stderr))
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
            command = [sys.executable, *args]
            try:
                rc = code.result(timeout)
            except TimeoutError:
                os.kill(pid.result(), 9)
                raise subprocess.TimeoutExpired(command, timeout) from None
            out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
            return subprocess.CompletedProcess(command, rc, out, err)

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def _server_for(env: dict[str, str]) -> ForkServer | None:
    """The server whose imports saw `env`, if `env` is this process's (less lazy variables)."""
    global _server
    wanted = fixed(env)
    with _server_lock:
        if _server is not None and _server.env == wanted:
            return _server
        if wanted != fixed(dict(os.environ)):
            return None
        if _server is not None:
            _server.close()
        else:
            atexit.register(lambda: _server and _server.close())
        _server = ForkServer(env)
        return _server


def python(
    args: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`."""
    server = _server_for(env) if args[0] in ("-m", "-c") else None
    if server is None:
        return subprocess.run(
            [sys.executable, *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return server.run(args, str(cwd or os.getcwd()), env, timeout)


if __name__ == "__main__":
    serve()
