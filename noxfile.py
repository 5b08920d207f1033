"""CI's lint, then README's test command against each vLLM release the plugin supports, each
in an environment of its own, installed as README tells an operator (through uv)."""

from __future__ import annotations

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
    session.install("-e", ".[test]", *VLLM[vllm])
    # Installing the plugin leaves the user's vLLM as it was.
    session.run(
        "python", "-c", f"import vllm; assert vllm.__version__ == {vllm!r}, vllm.__version__"
    )
    session.run("vllm-dsa-dbo", "status")
    session.run("python", "-m", "pytest", "-q", *session.posargs)
