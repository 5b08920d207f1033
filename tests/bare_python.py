"""A Python environment that has the installed plugin but not vLLM, for the tests of what its
commands say there: a virtual environment whose site-packages links in only what it names."""

from __future__ import annotations

import subprocess
import venv
from importlib.metadata import distribution
from importlib.util import find_spec
from pathlib import Path


def installed(name: str) -> list[Path]:
    """Distribution `name`'s top-level package and its dist-info folder, where installed."""
    dist = distribution(name)
    package = Path(find_spec(name.replace("-", "_")).origin).parent
    info = Path(dist.locate_file("")) / f"{name.replace('-', '_')}-{dist.version}.dist-info"
    assert info.is_dir(), info
    return [package, info]


def python(root: Path, *, vllm: bool = False, packaging: bool = True) -> Path:
    """The interpreter of a new environment under `root` holding the plugin and, as asked,
    packaging (its one dependency) and vLLM's files without anything vLLM requires."""
    venv.create(root, symlinks=True, with_pip=False)
    exe = root / "bin" / "python"
    site = subprocess.run(
        [exe, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    linked = installed("vllm-dsa-dbo")
    if packaging:
        linked.extend(installed("packaging"))
    if vllm:
        linked.extend(installed("vllm"))
    for path in linked:
        (Path(site) / path.name).symlink_to(path)
    return exe


def run(exe: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`vllm-dsa-dbo ARGS` run by `exe`, as its console script runs it."""
    return subprocess.run(
        [exe, "-m", "vllm_dsa_dbo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
