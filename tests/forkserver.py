"""`python ARGS` runs forked from one interpreter that imported torch and vLLM once.

Most of a short `python -m pytest TEST` or `python -m vllm_dsa_dbo.cli` run goes to importing
torch and vLLM. A server imports them, never this package, and forks a child per run; the child
takes the run's environment, working directory, argv and sys.path (its PYTHONPATH first, as a
fresh interpreter's), so the package it imports is the run's own copy. The server imports in
the environment of its runs, less the variables read only when used (`lazy`): where this
process's environment has changed since (imports set some), a new server replaces it; a run
with an environment of its own (not this process's) runs as a real subprocess. A run that
itself runs `python` (a test of a subprocess, under a mutation) asks the same server, over the
socket its environment names, instead of starting one of its own.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import socket
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

# Heavy imports of every run; none imports the package under test or starts a thread.
PRELOAD = (
    "flashinfer.decode",
    "pytest",
    "torch",
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
)
PACKAGE = "vllm_dsa_dbo"
SOCKET = "FORKSERVER_SOCKET"


def lazy(name: str) -> bool:
    """Read only when used: by the import system, pytest, vLLM's plugin loader, the package."""
    return name in ("PYTHONPATH", "PYTEST_CURRENT_TEST", "VLLM_PLUGINS", SOCKET) or name.startswith(
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
    os.environ.update(request["env"], **{SOCKET: request["socket"]})
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


def _accept(listener: socket.socket, env: dict[str, str]) -> tuple[dict, int] | None:
    """A run's request from a connection, and where to answer it; None if refused."""
    conn, _ = listener.accept()
    with conn, conn.makefile() as reader:
        request = json.loads(reader.readline())
        if fixed(request["env"]) != env:
            _send(conn.fileno(), {"refused": True})
            return None
        return request, os.dup(conn.fileno())


def serve() -> None:
    """Reads one JSON request a line from stdin until EOF and answers on stdout; runs'
    own runs connect to its socket, one request a connection, answered there."""
    env = fixed(dict(os.environ))
    for name in PRELOAD:
        importlib.import_module(name)
    if PACKAGE in sys.modules:
        raise RuntimeError(f"preloading imported {PACKAGE}: every run would share it")
    if threading.active_count() > 1:
        raise RuntimeError("preloading started a thread: forking could deadlock the runs")
    # Out of the collector's sight: every run's collections skip the preloaded heap.
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.dup(1)
    _redirect(1, os.devnull, os.O_WRONLY)
    path = os.path.join(tempfile.mkdtemp(), "socket")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    _send(out, {"ready": True})
    monitors, pending = set(), b""
    while True:
        requests = []
        ready = select.select([0, listener], [], [])[0]
        if listener in ready and (accepted := _accept(listener, env)):
            requests.append(accepted)
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            requests += [(json.loads(line), out) for line in lines]
        for request, answer in requests:
            pid = os.fork()
            if pid == 0:
                _monitor({**request, "socket": path}, answer)
            monitors.add(pid)
            if answer != out:
                os.close(answer)
        while monitors and (done := os.waitpid(-1, os.WNOHANG)[0]):
            monitors.discard(done)
    listener.close()
    os.unlink(path)
    for pid in monitors:
        os.waitpid(pid, 0)


# A started run's pid, and its exit code within a timeout (TimeoutError past it).
Started = tuple[Callable[[], int], Callable[[float | None], int]]


def _run(
    submit: Callable[[dict], Started | None],
    args: list[str],
    cwd: str,
    env: dict[str, str],
    timeout: float | None,
) -> subprocess.CompletedProcess | None:
    """The run `submit` starts from its request, as `subprocess.run` returns it; None if
    the server refused it."""
    with tempfile.TemporaryDirectory() as tmp:
        stdout, stderr = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"args": args, "cwd": cwd, "env": env, "stdout": str(stdout)}
        started = submit({**request, "stderr": str(stderr)})
        if started is None:
            return None
        pid, code = started
        command = [sys.executable, *args]
        try:
            rc = code(timeout)
        except TimeoutError:
            os.kill(pid(), 9)
            raise subprocess.TimeoutExpired(command, timeout) from None
        out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
        return subprocess.CompletedProcess(command, rc, out, err)


def _submit_to_socket(path: str, request: dict) -> Started | None:
    """`request` to the server listening at `path`; None if it refused it."""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    conn.sendall((json.dumps({**request, "id": 0}) + "\n").encode())
    reader = conn.makefile()
    started = json.loads(reader.readline())
    if "refused" in started:
        conn.close()
        return None

    def code(timeout: float | None) -> int:
        conn.settimeout(timeout)
        try:
            return json.loads(reader.readline())["rc"]
        finally:
            conn.close()

    return lambda: started["pid"], code


class ForkServer:
    """The server's client: `submit` is thread-safe and runs proceed in parallel."""

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

    def submit(self, request: dict) -> Started:
        with self._lock:
            run_id = self._next_id
            self._next_id += 1
            pid, code = Future(), Future()
            self._pids[run_id], self._codes[run_id] = pid, code
            self._process.stdin.write(json.dumps({**request, "id": run_id}) + "\n")
            self._process.stdin.flush()
        return pid.result, code.result

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
    args: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float | None = 600
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`."""
    result = None
    if args[0] in ("-m", "-c"):
        where = str(cwd or os.getcwd())
        if path := os.environ.get(SOCKET):
            result = _run(lambda r: _submit_to_socket(path, r), args, where, env, timeout)
        if result is None and (server := _server_for(env)):
            result = _run(server.submit, args, where, env, timeout)
    if result is None:
        return subprocess.run(
            [sys.executable, *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return result


if __name__ == "__main__":
    serve()
