"""The plugin's constants, environment switches and logger: the leaf every layer may import."""

from __future__ import annotations

import logging
import os

from packaging.version import InvalidVersion, Version

# The vLLM releases the plugin patches; where a seam differs between them, its Patch
# record says so.
RELEASES = ("0.33.0", "0.34.0")
SUPPORTED_VLLM = " and ".join(RELEASES)
DISABLE_ENV = "VLLM_DSA_DBO_DISABLE"
CHECK_ENV = "VLLM_DSA_DBO_CHECK"
CHECK_MODES = ("raise", "audit")
# Chose between two layouts of microbatches 1..'s top-k before the token-offset one became
# the only one: set, it is reported as no longer read.
RETIRED_LAYOUT_ENV = "VLLM_DSA_DBO_LAYOUT"
# How every DBO refusal ends: run without DBO (and, for HiSparse, without HiSparse).
DROP_DBO = "Drop --enable-dbo (and --ubatch-size)"
NO_HISPARSE = ", or turn HiSparse off (attention_config.hisparse_config)"
# Under "vllm." so that lines carry vLLM's log format and level.
LOGGER_NAME = "vllm.dsa_dbo"

# The spellings of "off" every plugin switch accepts, and of "on" for a yes/no one.
OFF = ("", "0", "false", "no", "off", "none")
ON = ("1", "true", "yes", "on")
# VLLM_DSA_DBO_DISABLE's modes: the fix off with its refusals kept, or vLLM as shipped.
REFUSE = "refuse"
STOCK = "stock"


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


def disable_mode() -> str | None:
    """VLLM_DSA_DBO_DISABLE: None (fix on), REFUSE or STOCK; EnvValueError for another value."""
    value = env_choice(
        DISABLE_ENV,
        (*ON, STOCK),
        f"turn the fix off and refuse what it would fix ({STOCK}: run vLLM's stock, corrupted "
        "behaviour for A/B runs)",
    )
    return value if value in (None, STOCK) else REFUSE


def check_mode() -> str | None:
    """The isolation checker mode VLLM_DSA_DBO_CHECK asks for; EnvValueError for another value."""
    return env_choice(CHECK_ENV, CHECK_MODES, "turn the checker on")


def retired_layout_notice() -> str | None:
    """What to say of a RETIRED_LAYOUT_ENV still set in the environment; None when unset."""
    if RETIRED_LAYOUT_ENV not in os.environ:
        return None
    return (
        f"{RETIRED_LAYOUT_ENV}={os.environ[RETIRED_LAYOUT_ENV]!r} is no longer read: "
        "microbatches 1.. always read microbatch 0's top-k buffers from their token offset"
    )


def refusal(problem: str, remedy: str = " for this model") -> ValueError:
    """Every DBO refusal in one form: what would go wrong, then how to run without it."""
    return ValueError(f"vllm-dsa-dbo: {problem} {DROP_DBO}{remedy}.")


def release_of(version: str) -> str | None:
    """The release in RELEASES whose seams `version` must fit: that release or a final point
    release of its series, local builds included; None for a pre-, dev or post-release, or
    another series."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.pre or parsed.dev is not None or parsed.post is not None:
        return None
    series = parsed.release[:2]
    return next((r for r in RELEASES if Version(r).release[:2] == series), None)


def is_supported_vllm(version: str) -> bool:
    return release_of(version) is not None


def logger() -> logging.Logger:
    """The plugin's vLLM logger."""
    from vllm.logger import init_logger

    return init_logger(LOGGER_NAME)
