"""vLLM plugin: DSA shared top-k state per dual-batch-overlap microbatch.

vLLM calls `register()` in every process (API server, engine core, workers)
before it builds a model.
"""

from __future__ import annotations

import os
from typing import Any

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


# VLLM_DSA_DBO_DISABLE's modes: the fix off with its refusals kept, or vLLM as shipped.
REFUSE = "refuse"
STOCK = "stock"


def disable_mode() -> str | None:
    """VLLM_DSA_DBO_DISABLE: None (fix on), REFUSE or STOCK; EnvValueError for another value."""
    value = env_choice(
        DISABLE_ENV,
        (*ON, STOCK),
        f"turn the fix off and refuse what it would fix ({STOCK}: run vLLM's stock, corrupted "
        "behaviour for A/B runs)",
    )
    return value if value in (None, STOCK) else REFUSE


def is_supported_vllm(version: str) -> bool:
    """0.33.0 and its local builds; never a pre-release or another release."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return parsed.public == SUPPORTED_VLLM


def register() -> None:
    """The `vllm.general_plugins` entry point; safe to call more than once; never raises."""
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)
    try:
        _register(logger)
    except Exception as e:  # raising here would stop every vLLM process, DBO or not
        from vllm_dsa_dbo import guard

        logger.exception("vllm-dsa-dbo: registration failed (%s)", e)
        guard.cover(logger, "vllm-dsa-dbo failed to register on this vLLM (see its error).")


def _register(logger: Any) -> None:
    from vllm_dsa_dbo import guard
    from vllm_dsa_dbo.diagnostics.isolation import install, mode_from_env

    try:
        check = mode_from_env()
    except EnvValueError as e:
        logger.error("vllm-dsa-dbo: %s. The isolation checker stays off.", e)
        check = None
    try:
        mode = disable_mode()
    except EnvValueError as e:
        logger.error("vllm-dsa-dbo: %s. The fix is applied.", e)
        mode = None
    if mode == STOCK:
        logger.warning(
            "vllm-dsa-dbo: %s=%s: nothing patched and nothing refused. With --enable-dbo, a "
            "DSA model with shared top-k layers (GLM-5.x) runs as stock vLLM does and its "
            "OUTPUTS WILL BE CORRUPTED (for A/B runs only)",
            DISABLE_ENV,
            STOCK,
        )
    if guard.stays_out(logger, refuse=mode != STOCK):
        return
    if mode == REFUSE:
        guard.cover(
            logger,
            f"vllm-dsa-dbo is turned off by {DISABLE_ENV}, which keeps its refusals "
            f"({DISABLE_ENV}={STOCK} runs stock vLLM, corrupted, for A/B runs).",
        )
    elif mode is None:
        from vllm_dsa_dbo.patches import LOAD_CHECK_MODULES, apply_all

        if not LOAD_CHECK_MODULES <= apply_all():
            guard.cover(logger, "vllm-dsa-dbo could not install its load-time check here.")
    if check is not None:
        install(check)
