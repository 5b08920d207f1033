"""vLLM plugin: DSA shared top-k state per dual-batch-overlap microbatch.

vLLM calls `register()` in every process (API server, engine core, workers)
before it builds a model.
"""

from __future__ import annotations

import os

from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = "0.33.0"
DISABLE_ENV = "VLLM_DSA_DBO_DISABLE"

# Under "vllm." so that lines carry vLLM's log format and level.
LOGGER_NAME = "vllm.dsa_dbo"

# The spellings of "off" every plugin switch accepts, and of "on" for a yes/no one.
OFF = ("", "0", "false", "no", "off", "none")
ON = ("1", "true", "yes", "on")


class EnvValueError(ValueError):
    """A plugin environment variable set to a value it does not know."""


def env_choice(name: str, choices: tuple[str, ...], meaning: str) -> str | None:
    """`name`'s value from `choices` (any case), None when unset or off; else EnvValueError."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in OFF:
        return None
    if value in choices:
        return value
    raise EnvValueError(
        f"{name}={raw!r} is not understood: set {_either(choices)} to {meaning}, or unset "
        f"it ({_either(OFF[1:])} also mean off)"
    )


def _either(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


def disabled_by_env() -> bool:
    """Whether VLLM_DSA_DBO_DISABLE turns the fix off; EnvValueError for an unknown value."""
    return env_choice(DISABLE_ENV, ON, "turn the fix off") is not None


def is_supported_vllm(version: str) -> bool:
    """0.33.0 and its local builds; never a pre-release or another release."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return parsed.public == SUPPORTED_VLLM


def register() -> None:
    """The `vllm.general_plugins` entry point; safe to call more than once."""
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)
    from vllm_dsa_dbo.isolation import install, mode_from_env

    try:
        check = mode_from_env()
    except EnvValueError as e:
        logger.error("vllm-dsa-dbo: %s. The isolation checker stays off.", e)
        check = None
    try:
        disabled = disabled_by_env()
    except EnvValueError as e:
        logger.error("vllm-dsa-dbo: %s. The fix is applied.", e)
        disabled = False
    if disabled and check is None:
        logger.info("vllm-dsa-dbo disabled by %s; nothing patched", DISABLE_ENV)
        return
    import vllm

    if not is_supported_vllm(vllm.__version__):
        logger.error(
            "vllm-dsa-dbo supports vLLM %s only, found %s: NOT patching. DSA models "
            "with shared top-k layers (GLM-5.x) give wrong results with "
            "--enable-dbo on this vLLM unless it carries the fix itself. Install "
            "vllm==%s, or a vllm-dsa-dbo release for your vLLM.",
            SUPPORTED_VLLM,
            vllm.__version__,
            SUPPORTED_VLLM,
        )
        return
    if disabled:
        logger.info("vllm-dsa-dbo disabled by %s; only its checker runs", DISABLE_ENV)
    else:
        from vllm_dsa_dbo.patches import apply_all

        apply_all()
    if check is not None:
        install(check)
