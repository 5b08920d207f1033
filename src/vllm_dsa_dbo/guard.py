"""Where the plugin cannot fix shared top-k under DBO (another vLLM version, a supported one
without its load-time check, the fix turned off), refuse it at config creation and model
build: a DSA model with shared top-k layers, or HiSparse, under DBO; nothing else."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from vllm_dsa_dbo.patches._shared import replace_function
from vllm_dsa_dbo.settings import (
    DROP_DBO,
    NO_HISPARSE,
    RELEASES,
    SUPPORTED_VLLM,
    is_supported_vllm,
    refusal,
)

# Config keys by which a vLLM 0.33.0 or 0.34.0 DSA model hands one layer's top-k to another.
SHARING_KEYS = (
    "index_topk_freq > 1",
    "an index_topk_pattern with 'S'",
    "indexer_types with 'shared'",
    "index_source_layer_ids",
    "candidate_source_layer_id",
    "index_sharing with a layer other than 'full'",
    "use_index_cache with index_topk_freq > 1",
)
# vLLM's own follower rules, by the first place ("module:function") a vLLM has each.
SKIP_TOPK_LAYERS = (
    "vllm.model_executor.models.utils:compute_skip_topk_layers",
    "vllm.models.hy_v4.nvidia.attention:compute_skip_topk_layers",
)
MISTRAL_LAYER_SPECS = ("vllm.models.mistral.common.layer_spec:get_layer_specs",)
_GUARDED = "_vllm_dsa_dbo_guard"
RUN_UNDER_DBO = (
    f" for this model, or, to run it under DBO, use vLLM {' or '.join(RELEASES)} with "
    "vllm-dsa-dbo enabled, which fixes or refuses each path (vllm PR #60734 alone fixes only "
    "the CUDA deepseek_v32 path)"
)
HISPARSE = (
    "HiSparse cannot run with dual batch overlap, whatever the model's index_topk_freq: its "
    "KV write takes the whole batch's slot mapping from row 0 "
    "(HiSparseCacheHandle.write_target), so microbatch 1 writes its KV into microbatch 0's "
    "slots, and its request state and block tables are bound for the whole batch."
)


def vllm_rule(places: tuple[str, ...]) -> Callable[[Any], Any] | None:
    """vLLM's own function at the first of `places` this vLLM has; None where it has none."""
    for place in places:
        module, _, name = place.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except Exception:  # this vLLM lacks it, or cannot import it here
            continue
    return None


def indexer_types_share(text_config: Any) -> bool:
    """Whether `indexer_types` makes a layer a follower, by vLLM's compute_skip_topk_layers."""
    skipped = vllm_rule(SKIP_TOPK_LAYERS)
    if skipped is None:
        return any(kind != "full" for kind in text_config.indexer_types)
    try:
        return bool(skipped(text_config))
    except Exception:  # vLLM cannot read it: refused rather than guessed
        return True


def index_sharing_shares(text_config: Any) -> bool:
    """Whether Mistral Large 4's `index_sharing` makes a layer a follower, by vLLM's layer
    specs: every value but exactly "full" is one."""
    specs = vllm_rule(MISTRAL_LAYER_SPECS)
    if specs is None:
        return any(kind != "full" for kind in text_config.index_sharing)
    try:
        return any(spec.use_sparse and not spec.has_indexer for spec in specs(text_config))
    except Exception:  # vLLM cannot read it: refused rather than guessed
        return True


def sharing_keys(text_config: Any) -> list[str]:
    """The SHARING_KEYS a DSA model's text config sets; [] when no layer reuses top-k."""
    # MiniMax-M3's rule (_should_skip_index_topk, in a module only ROCm imports); its config
    # has no index_topk.
    if getattr(text_config, "use_index_cache", False) and (
        int(getattr(text_config, "index_topk_freq", 1) or 1) > 1
    ):
        return [SHARING_KEYS[-1]]
    if getattr(text_config, "index_topk", None) is None:
        return []
    freq = getattr(text_config, "index_topk_freq", None)
    source = getattr(text_config, "candidate_source_layer_id", None)
    # deepseek_v2's rule is inline (no function to call), and it ignores indexer_types: any
    # frequency or pattern that could skip a layer counts.
    found = [
        freq is not None and freq != 1,
        "S" in (getattr(text_config, "index_topk_pattern", None) or ""),
        getattr(text_config, "indexer_types", None) is not None
        and indexer_types_share(text_config),
        bool(getattr(text_config, "index_source_layer_ids", None)),
        source is not None and source != -1,
        getattr(text_config, "index_sharing", None) is not None
        and index_sharing_shares(text_config),
    ]
    return [key for key, hit in zip(SHARING_KEYS, found) if hit]


def uses_dbo(parallel_config: Any) -> bool:
    return bool(getattr(parallel_config, "enable_dbo", False)) or (
        (getattr(parallel_config, "ubatch_size", 0) or 0) > 1
    )


def refuse_hisparse(vllm_config: Any) -> None:
    """Raise for HiSparse under DBO, which vLLM corrupts whatever the layout."""
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "hisparse_config", None) is not None and uses_dbo(
        vllm_config.parallel_config
    ):
        raise refusal(HISPARSE, NO_HISPARSE)


def refuse_unfixed(vllm_config: Any, why: str) -> None:
    """Raise for DBO with a shared-top-k DSA model or HiSparse, which this vLLM would corrupt."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not uses_dbo(vllm_config.parallel_config):
        return
    refuse_hisparse(vllm_config)
    text_config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    keys = sharing_keys(text_config)
    if keys:
        raise refusal(
            f"{getattr(model_config, 'architecture', 'this model')} shares "
            f"top-k between layers ({', '.join(keys)}), and with dual batch overlap one "
            "microbatch's leader layers overwrite the top-k the other microbatch's "
            f"followers read: wrong answers, no error. {why}",
            RUN_UNDER_DBO,
        )


def _at_config_creation() -> Callable[[str], None]:
    from vllm.config import VllmConfig

    stock = VllmConfig.__post_init__

    def install(why: str) -> None:
        def __post_init__(self: Any) -> None:
            stock(self)
            refuse_unfixed(self, why)

        VllmConfig.__post_init__ = __post_init__

    return install


def takes_vllm_config(build: Callable) -> str | None:
    """None when `build` takes the `vllm_config` a model-build seam reads, else what differs."""
    if "vllm_config" in inspect.signature(build).parameters:
        return None
    return f"{build.__module__}.{build.__name__} takes no vllm_config parameter"


def _at_model_build(module: str, name: str) -> Callable[[], Callable[[str], None]]:
    """The seam finder for `module.name`, a function that builds a model for `vllm_config`."""

    def find() -> Callable[[str], None]:
        holder = importlib.import_module(module)
        stock = getattr(holder, name)
        if (differs := takes_vllm_config(stock)) is not None:
            raise TypeError(differs)
        signature = inspect.signature(stock)

        def install(why: str) -> None:
            def build(*args: Any, **kwargs: Any) -> Any:
                refuse_unfixed(signature.bind(*args, **kwargs).arguments["vllm_config"], why)
                return stock(*args, **kwargs)

            replace_function(holder, name, build)

        return install

    return find


# Config creation, and model build for a config made before register() (unpickled in a
# worker), by every loader's build and a vLLM-tensorized model's: each finds its seam,
# raising where this vLLM lacks it, and returns its installer.
LOADERS = "vllm.model_executor.model_loader"
SEAMS: dict[str, Callable[[], Callable[[str], None]]] = {
    "vllm.config.VllmConfig.__post_init__": _at_config_creation,
    f"{LOADERS}.utils.initialize_model": _at_model_build(f"{LOADERS}.utils", "initialize_model"),
    f"{LOADERS}.tensorizer.init_tensorizer_model": _at_model_build(
        f"{LOADERS}.tensorizer", "init_tensorizer_model"
    ),
}


def seams() -> dict[str, Callable[[str], None]]:
    """The seams this vLLM has for the guard, each with its installer; installs nothing."""
    found = {}
    for name, find in SEAMS.items():
        try:
            found[name] = find()
        except Exception:  # this vLLM lacks the seam: the others still guard
            continue
    return found


def install(why: str) -> str | None:
    """Install the guard at every seam this vLLM has, once per process.

    Returns the seams' names, or None where no seam could be installed. `why`
    ends the refusal's first sentence: why the plugin cannot fix it here.
    """
    import vllm

    installed = getattr(vllm, _GUARDED, None)
    if installed is not None:
        return installed
    found = seams()
    for put in found.values():
        put(why)
    if not found:
        return None
    setattr(vllm, _GUARDED, " and ".join(found))
    return getattr(vllm, _GUARDED)


def install_and_log(logger: Any, why: str) -> None:
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
            "refused (guard at %s). %s%s.",
            why,
            seam,
            DROP_DBO,
            RUN_UNDER_DBO,
        )


def unsupported_version() -> str | None:
    """Why the plugin patches nothing in this vLLM, another version; None for a supported one.

    A vLLM carrying vllm PR #60734 is no exception: the PR fixes one path of
    several, and which of the others an unknown version fixes cannot be told.
    """
    import vllm

    if is_supported_vllm(vllm.__version__):
        return None
    return (
        f"vllm-dsa-dbo supports vLLM {SUPPORTED_VLLM} only, found {vllm.__version__}: NOT patching."
    )
