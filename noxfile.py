"""CI's lint, then README's test command against each vLLM release the plugin supports, each
in an environment of its own: vLLM installed as README tells an operator (through uv), the
plugin from the wheel built here, as users install it."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

CONSTRAINTS = ("--constraint", ".ci/vllm-constraints.txt")
# What each release's install needs besides its pin.
VLLM = {
    "0.33.0": CONSTRAINTS,
    "0.34.0": (*CONSTRAINTS, "--override", ".ci/vllm-0.34.0-overrides.txt"),
}


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("vllm", list(VLLM))
def tests(session: nox.Session, vllm: str) -> None:
    session.install(f"vllm=={vllm}", *VLLM[vllm])
    wheel = build(session)
    session.install(f"{wheel}[test]", "--reinstall-package", "vllm-dsa-dbo", *VLLM[vllm])
    # Installing the plugin leaves the user's vLLM as it was; the suite imports the wheel's
    # package, not src/.
    session.run(
        "python", "-c", f"import vllm; assert vllm.__version__ == {vllm!r}, vllm.__version__"
    )
    session.run(
        "python", "-c", "import vllm_dsa_dbo as p; assert 'site-packages' in p.__file__, p.__file__"
    )
    session.run("vllm-dsa-dbo", "status")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


def build(session: nox.Session) -> Path:
    """The sdist, and the wheel built from it as an index would serve them: their metadata
    checked, and every file of the package under src/ in the wheel."""
    out = Path(session.virtualenv.location) / "dist"
    shutil.rmtree(out, ignore_errors=True)
    # run_install: also under --install-only, which installs the wheel this builds.
    session.run_install("uv", "build", "--out-dir", str(out), silent=True)
    [sdist], [wheel] = out.glob("*.tar.gz"), out.glob("*.whl")
    session.run_install("uvx", "twine", "check", "--strict", str(sdist), str(wheel))
    packaged = set(zipfile.ZipFile(wheel).namelist())
    tracked = session.run_install("git", "ls-files", "src", external=True, silent=True).split()
    missing = [path for path in tracked if path.removeprefix("src/") not in packaged]
    if missing:
        session.error(f"{wheel.name} lacks {', '.join(missing)}")
    return wheel
