"""Where the plugin cannot fix shared top-k under DBO, refuse it instead.

vLLM versions other than 0.33.0, and a 0.33.0 whose load-time check could not
be installed, get a guard that refuses, at config creation, a DSA model with
shared top-k layers under DBO; nothing else changes. A vLLM that carries the
upstream fix needs neither.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm_dsa_dbo import SUPPORTED_VLLM, is_supported_vllm

# Config keys by which a vLLM 0.33.0 DSA model hands one layer's top-k to another.
SHARING_KEYS = (
    "index_topk_freq > 1",
    "an index_topk_pattern with 'S'",
    "indexer_types with 'shared'",
    "index_source_layer_ids",
    "candidate_source_layer_id",
)
_GUARDED = "_vllm_dsa_dbo_guard"
REMEDY = (
    "Drop --enable-dbo (and --ubatch-size) for this model, or, to run it under DBO, "
    f"install vllm=={SUPPORTED_VLLM} with vllm-dsa-dbo or a vLLM release that carries "
    "vllm PR #60734."
)


def upstream_fix_present() -> bool:
    """vLLM's own index-group builder takes the microbatch count (vllm PR #60734)."""
    try:
        from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

        init = SparseMLAIndexGroupBuilder.__init__
        return (
            not init.__module__.startswith("vllm_dsa_dbo")
            and "num_ubatches" in inspect.signature(init).parameters
        )
    except Exception:  # no such builder, or one inspect cannot read
        return False


def sharing_keys(text_config: Any) -> list[str]:
    """The SHARING_KEYS a DSA model's text config sets; [] when no layer reuses top-k."""
    if getattr(text_config, "index_topk", None) is None:
        return []
    freq = getattr(text_config, "index_topk_freq", None)
    source = getattr(text_config, "candidate_source_layer_id", None)
    found = [
        freq is not None and freq != 1,
        "S" in (getattr(text_config, "index_topk_pattern", None) or ""),
        "shared" in (getattr(text_config, "indexer_types", None) or ()),
        bool(getattr(text_config, "index_source_layer_ids", None)),
        source is not None and source != -1,
    ]
    return [key for key, hit in zip(SHARING_KEYS, found) if hit]


def uses_dbo(parallel_config: Any) -> bool:
    return bool(getattr(parallel_config, "enable_dbo", False)) or (
        (getattr(parallel_config, "ubatch_size", 0) or 0) > 1
    )


def refuse_unfixed(vllm_config: Any, why: str) -> None:
    """Raise for DBO with a shared-top-k DSA model, which this vLLM would corrupt."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not uses_dbo(vllm_config.parallel_config):
        return
    text_config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    keys = sharing_keys(text_config)
    if keys:
        raise ValueError(
            f"vllm-dsa-dbo: {getattr(model_config, 'architecture', 'this model')} shares "
            f"top-k between layers ({', '.join(keys)}), and with dual batch overlap one "
            "microbatch's leader layers overwrite the top-k the other microbatch's "
            f"followers read: wrong answers, no error. {why} {REMEDY}"
        )


def _guard_config(why: str) -> None:
    from vllm.config import VllmConfig

    stock = VllmConfig.__post_init__

    def __post_init__(self: Any) -> None:
        stock(self)
        refuse_unfixed(self, why)

    VllmConfig.__post_init__ = __post_init__


def _guard_model_build(why: str) -> None:
    from vllm.model_executor.model_loader import utils

    from vllm_dsa_dbo.patches import replace_function

    stock = utils.initialize_model
    signature = inspect.signature(stock)
    if "vllm_config" not in signature.parameters:
        raise TypeError("initialize_model takes no vllm_config")

    def initialize_model(*args: Any, **kwargs: Any) -> Any:
        refuse_unfixed(signature.bind(*args, **kwargs).arguments["vllm_config"], why)
        return stock(*args, **kwargs)

    replace_function(utils, "initialize_model", initialize_model)


# Tried in order; each needs only the names it is called by.
SEAMS: dict[str, Callable[[str], None]] = {
    "vllm.config.VllmConfig.__post_init__": _guard_config,
    "vllm.model_executor.model_loader.utils.initialize_model": _guard_model_build,
}


def install(why: str) -> str | None:
    """Install the guard at the first seam this vLLM has, once per process.

    Returns the seam's name, or None where no seam could be installed. `why`
    ends the refusal's first sentence: why the plugin cannot fix it here.
    """
    import vllm

    installed = getattr(vllm, _GUARDED, None)
    if installed is not None:
        return installed
    for seam, guard in SEAMS.items():
        try:
            guard(why)
        except Exception:  # this vLLM lacks the seam: try the next
            continue
        setattr(vllm, _GUARDED, seam)
        return seam
    return None


def cover(logger: Any, why: str) -> None:
    """Install the guard where the fix is not in force, and log where it went."""
    seam = install(why)
    if seam is None:
        logger.error(
            "%s No guard seam was found either: DSA models with shared top-k layers "
            "(GLM-5.x) give wrong results with --enable-dbo here.",
            why,
        )
    else:
        logger.warning(
            "%s With --enable-dbo, a DSA model with shared top-k layers (GLM-5.x) is "
            "refused (guard at %s). %s",
            why,
            seam,
            REMEDY,
        )


def stays_out(logger: Any) -> bool:
    """Whether this vLLM is not one to patch: it carries the upstream fix (then
    nothing is needed) or is another version (then the guard goes in)."""
    import vllm

    if upstream_fix_present():
        logger.info(
            "vllm-dsa-dbo: vLLM %s carries the upstream fix (its index-group builder "
            "takes num_ubatches): nothing patched",
            vllm.__version__,
        )
        return True
    if is_supported_vllm(vllm.__version__):
        return False
    cover(
        logger,
        f"vllm-dsa-dbo supports vLLM {SUPPORTED_VLLM} only, found {vllm.__version__}: "
        "NOT patching.",
    )
    return True
