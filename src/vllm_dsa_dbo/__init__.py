"""vLLM plugin: DSA shared top-k state per dual-batch-overlap microbatch.

vLLM calls `register()` in every process (API server, engine core, workers)
before it builds a model.
"""

from __future__ import annotations

import logging

# The one place the version is written: the wheel's metadata reads it (pyproject.toml).
__version__ = "0.1.0"


def register() -> None:
    """The `vllm.general_plugins` entry point; safe to call more than once; never raises."""
    from vllm_dsa_dbo import settings

    logger = settings.logger()
    try:
        _register(logger)
    except Exception as e:  # raising here would stop every vLLM process, DBO or not
        from vllm_dsa_dbo import guard

        logger.exception("vllm-dsa-dbo: registration failed (%s)", e)
        guard.install_and_log(
            logger, "vllm-dsa-dbo failed to register on this vLLM (see its error)."
        )


def _register(logger: logging.Logger) -> None:
    from vllm_dsa_dbo import guard, patches, settings
    from vllm_dsa_dbo.diagnostics import isolation, load_check
    from vllm_dsa_dbo.settings import DISABLE_ENV, REFUSE, STOCK, EnvValueError

    try:
        check = settings.check_mode()
    except EnvValueError as e:
        logger.error("vllm-dsa-dbo: %s. The isolation checker stays off.", e)
        check = None
    retired = settings.retired_layout_notice()
    if retired:
        logger.warning("vllm-dsa-dbo: %s.", retired)
    try:
        mode = settings.disable_mode()
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
    if (unsupported := guard.unsupported_version()) is not None:
        if mode != STOCK:
            guard.install_and_log(logger, unsupported)
        return
    if mode == REFUSE:
        guard.install_and_log(
            logger,
            f"vllm-dsa-dbo is turned off by {DISABLE_ENV}, which keeps its refusals "
            f"({DISABLE_ENV}={STOCK} runs stock vLLM, corrupted, for A/B runs).",
        )
    elif mode is None:
        in_force = patches.apply_all([*patches.fix_patches(), *load_check.PATCHES])
        if not {p.name for p in load_check.PATCHES} <= in_force:
            guard.install_and_log(
                logger, "vllm-dsa-dbo could not install its load-time check here."
            )
    if check is not None:
        isolation.install(check)
