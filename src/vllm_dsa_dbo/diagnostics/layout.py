"""For `memory`: which layers of a DSA model lead, which follow, and what the plugin keeps
per DBO microbatch for them, per code path of the installed vLLM release.

`check_config` reads only the JSON (no torch, no vLLM) and refuses what vLLM would refuse
or misread; the rules are then vLLM's own functions of the config (`RULES` says where each
release keeps them), and the DeepSeek-V4.1 one the patch allocates by.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from types import SimpleNamespace
from typing import Any

from vllm_dsa_dbo.settings import RELEASES, SUPPORTED_VLLM, release_of

# What the plugin keeps per extra microbatch on a code path whose layers share top-k.
GROUPS = "per index group with followers, its valid counts (top-k rows at the token offset)"
LOGICAL = "nothing (followers build private single-layer groups; top-k at the token offset)"
REFUSED = "refused under DBO"
MODEL_WIDE = "a copy of each model-wide buffer another layer reads (top-k, candidate blocks)"
UNSHARED = "nothing: every sparse layer runs its own indexer"

# No model has more; a bound keeps a mistyped count from running for hours.
MAX_LAYERS = 100_000


class ConfigError(ValueError):
    """A config vLLM would refuse or misread, or one of a model the plugin never touches."""


@dataclass(frozen=True)
class CodePath:
    """The vLLM code that builds an architecture on a platform, and its leader rule."""

    module: str
    rule: str | None  # a key of _RULE_CHECKS; None: nothing shared
    kept: str


_V32 = {
    "cuda": CodePath("vllm/models/deepseek_v32/nvidia", "dsa", GROUPS),
    "rocm": CodePath("vllm/models/deepseek_v32/amd", "dsa", LOGICAL),
}
_V2 = {
    "cuda": CodePath("vllm/model_executor/models/deepseek_v2.py", "dsa", GROUPS),
    "rocm": CodePath("vllm/model_executor/models/deepseek_v2.py", "dsa", REFUSED),
}
_GLM4_LITE = {
    "cuda": CodePath("vllm/model_executor/models/glm4_moe_lite.py", "dsa", GROUPS),
    "rocm": CodePath("vllm/model_executor/models/glm4_moe_lite.py", "dsa", REFUSED),
}
_MINIMAX_M3 = {
    "cuda": CodePath("vllm/models/minimax_m3/nvidia", None, UNSHARED),
    "rocm": CodePath("vllm/models/minimax_m3/amd", "minimax_m3", REFUSED),
}
_GLM5_NEXT = dict.fromkeys(("cuda", "rocm"), CodePath("vllm/models/glm5next", None, UNSHARED))

# Every vLLM 0.33.0 DSA model class (the README's coverage table), by platform; vLLM
# registers each under its own name.
_CODE_PATHS_033: dict[str, dict[str, CodePath]] = {
    "GlmMoeDsaForCausalLM": _V32,
    "DeepseekV32ForCausalLM": _V32,
    "DeepseekV3ForCausalLM": _V2,
    "DeepseekV2ForCausalLM": _V2,
    "Glm4MoeLiteForCausalLM": _GLM4_LITE,
    "HYV4ForCausalLM": {
        "cuda": CodePath("vllm/models/hy_v4/nvidia", "hy_v4", LOGICAL),
        "rocm": CodePath("vllm/models/hy_v4/amd", "hy_v4", REFUSED),
    },
    "DeepseekV41ForCausalLM": {
        "cuda": CodePath("vllm/models/deepseek_v41/nvidia", "deepseek_v41", MODEL_WIDE),
        "rocm": CodePath("vllm/models/deepseek_v41/amd", "deepseek_v41", REFUSED),
    },
    "MiniMaxM3SparseForCausalLM": _MINIMAX_M3,
    "MiniMaxM3SparseForConditionalGeneration": _MINIMAX_M3,
    "Glm5NextForCausalLM": _GLM5_NEXT,
    "Glm5NextForConditionalGeneration": _GLM5_NEXT,
}
# 0.34.0's GLM-5 / V3.2 path calls compute_skip_topk_layers, which reads indexer_types first.
_V32_034 = {
    "cuda": CodePath("vllm/models/deepseek_v32/nvidia", "dsa_indexer_types", GROUPS),
    "rocm": CodePath("vllm/models/deepseek_v32/amd", "dsa_indexer_types", LOGICAL),
}
# 0.34.0's ROCm MiniMax-M3 takes its sparse layers from layer_types.
_MINIMAX_M3_034 = {
    **_MINIMAX_M3,
    "rocm": CodePath("vllm/models/minimax_m3/amd", "minimax_m3_layer_types", REFUSED),
}
# One shared index group builder on both platforms, as GLM-5 on CUDA.
_MISTRAL_LARGE4 = {
    "cuda": CodePath("vllm/models/mistral/mistral_large4/nvidia", "index_sharing", GROUPS),
    "rocm": CodePath("vllm/models/mistral/mistral_large4/amd", "index_sharing", REFUSED),
}


@dataclass(frozen=True)
class ReleaseRules:
    """Where one vLLM release keeps what `layout` reads, where it moved since 0.33.0."""

    skip_topk: str  # the module that defines compute_skip_topk_layers
    # The DSA model classes it builds otherwise than 0.33.0 does, or that 0.33.0 lacks.
    changed: Mapping[str, Mapping[str, CodePath]]


RULES: dict[str, ReleaseRules] = {
    "0.33.0": ReleaseRules("vllm.models.hy_v4.nvidia.attention", {}),
    "0.34.0": ReleaseRules(
        "vllm.model_executor.models.utils",
        {
            "GlmMoeDsaForCausalLM": _V32_034,
            "DeepseekV32ForCausalLM": _V32_034,
            "MiniMaxM3SparseForCausalLM": _MINIMAX_M3_034,
            "MiniMaxM3SparseForConditionalGeneration": _MINIMAX_M3_034,
            "MistralLarge4ForCausalLM": _MISTRAL_LARGE4,
        },
    ),
}
PLATFORMS = ("cuda", "rocm")
# The DSA model vLLM builds from a Mistral-format folder's params.json.
_MISTRAL_DSA = "MistralLarge4ForCausalLM"


def installed_vllm() -> str | None:
    """The installed vLLM's version, None without one."""
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


VLLM_VERSION = installed_vllm()
# A vLLM of no release here (status says it is unsupported) is read by the newest one's rules.
RELEASE = release_of(VLLM_VERSION or "") or RELEASES[-1]
# The DSA model classes the installed release builds, by platform.
CODE_PATHS: dict[str, Mapping[str, CodePath]] = {**_CODE_PATHS_033, **RULES[RELEASE].changed}


@dataclass(frozen=True)
class Layout:
    """One model's leaders and followers on one code path."""

    architecture: str
    path: CodePath
    num_layers: int
    index_topk: int
    # None where the leader rule is not one of index groups (nothing shared, or
    # top-k handed outside them).
    leaders: list[int] | None
    followers: list[int]
    # Index groups that read another layer's top-k, as the startup line counts them.
    groups_with_followers: int
    notes: list[str]
    # (name, int32 columns) of each `max_num_batched_tokens`-row buffer copied on a
    # MODEL_WIDE path.
    buffers: tuple[tuple[str, int], ...] = ()

    @property
    def refused_under_dbo(self) -> bool:
        return self.path.kept == REFUSED and bool(self.followers)


# Checks ---------------------------------------------------------------------


def _describe(value: Any) -> str:
    return "null" if value is None else repr(value)


def _whole(config: Mapping[str, Any], key: str, default: Any, minimum: int | None) -> Any:
    value = config.get(key, default)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or (minimum is not None and value < minimum)
    ):
        kind = "a whole number" if minimum is None else f"a whole number >= {minimum}"
        raise ConfigError(f"{key} must be {kind}, got {_describe(value)}")
    return value


def _list_of(config: Mapping[str, Any], key: str, kind: type) -> list | None:
    value = config.get(key)
    if value is not None and not (
        isinstance(value, list)
        and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
    ):
        raise ConfigError(f"{key} must be a list of {kind.__name__}, got {_describe(value)}")
    return value


def check_config(config: Mapping[str, Any], platform: str = "cuda") -> tuple[CodePath, dict]:
    """The code path and text config vLLM would build from `config`, checked for
    every key its leader rule reads; ConfigError says what to change."""
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be a JSON object, got {_describe(text)}")
    architectures = config.get("architectures", text.get("architectures"))
    if (
        not architectures
        or not isinstance(architectures, list)
        or not all(isinstance(a, str) and a for a in architectures)
    ):
        raise ConfigError(
            'architectures must name the model class, e.g. ["GlmMoeDsaForCausalLM"] '
            f"(vLLM picks its code from it), got {_describe(architectures)}"
        )
    architecture, model_class = built_class(architectures)
    if model_class not in CODE_PATHS:
        raise ConfigError(not_built(architecture))
    path = CODE_PATHS[model_class][platform]
    num_layers = _whole(text, "num_hidden_layers", None, 1)
    if num_layers > MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers must be at most {MAX_LAYERS:,}, got {num_layers:,}")
    if "index_topk" not in text:
        raise ConfigError(
            "no index_topk: not a DeepSeek Sparse Attention config (the top-k buffers are "
            "index_topk wide)"
        )
    _whole(text, "index_topk", None, 1)
    _RULE_CHECKS.get(path.rule, lambda text: None)(text)
    return path, {**text, "architectures": [architecture]}


def from_mistral(params: dict) -> dict:
    """params.json as vLLM's Mistral parser makes it (config.json's defaults fill no key read)."""
    if _MISTRAL_DSA not in CODE_PATHS:
        raise ConfigError(not_built(_MISTRAL_DSA))
    from vllm.transformers_utils.configs.mistral import adapt_config_dict

    try:
        return adapt_config_dict(params, defaults={}).to_dict()
    except Exception as e:  # its asserts and lookups: vLLM stops there too
        raise ConfigError(f"vLLM's Mistral config parser refuses it: {e!r}") from None


def not_built(architecture: str) -> str:
    """Why the installed vLLM builds no DSA model for `architecture`."""
    newer = [r for r, rules in RULES.items() if architecture in rules.changed]
    if newer:
        return (
            f"{architecture} is new in vLLM {newer[0]}: the installed vLLM {VLLM_VERSION} "
            "does not build it, and the plugin allocates nothing for it"
        )
    return (
        f"{architecture} is not a DSA model: vLLM {VLLM_VERSION} builds no layer that hands "
        "top-k to another for it, and the plugin allocates nothing (the README's "
        "coverage table lists the DSA architectures)"
    )


def built_class(architectures: list[str]) -> tuple[str, str | None]:
    """The architecture vLLM's registry resolves first in `architectures`, and the class
    it builds for it (None where it knows none); the registry, which imports vLLM, is read
    only where the first is not a DSA class."""
    if architectures[0] in CODE_PATHS:
        return architectures[0], architectures[0]
    from vllm.model_executor.models.registry import ModelRegistry

    for architecture in architectures:
        # As resolve_model_cls: aliases and adapter suffixes (ForSequenceClassification) too.
        normalized = ModelRegistry._normalize_arch(architecture, SimpleNamespace())
        if normalized in ModelRegistry.models:
            return architecture, ModelRegistry.models[normalized].class_name
    return architectures[0], None


def _check_dsa(text: Mapping[str, Any]) -> None:
    pattern = text.get("index_topk_pattern")
    if pattern is not None and (
        not isinstance(pattern, (str, list)) or not all(c in ("F", "S") for c in pattern)
    ):
        raise ConfigError(
            "index_topk_pattern must be F (runs the indexer) or S (reuses the top-k) per "
            f'layer, e.g. "FFFSSSF", got {_describe(pattern)}'
        )
    if pattern is None:
        _whole(text, "index_topk_freq", 1, 1)
        _whole(text, "index_skip_topk_offset", 2, None)


def _check_full_or_shared(text: Mapping[str, Any], key: str) -> list[str] | None:
    kinds = _list_of(text, key, str)
    if kinds is not None and (
        len(kinds) != text["num_hidden_layers"] or set(kinds) - {"full", "shared"}
    ):
        raise ConfigError(
            f"{key} must hold 'full' or 'shared' for each of the "
            f"{text['num_hidden_layers']} layers, got {kinds!r}"
        )
    return kinds


def _check_dsa_indexer_types(text: Mapping[str, Any]) -> None:
    if _check_full_or_shared(text, "indexer_types") is None:
        _check_dsa(text)


def _check_hy_v4(text: Mapping[str, Any]) -> None:
    _list_of(text, "layer_types", str)
    _check_full_or_shared(text, "indexer_types")


def _check_index_sharing(text: Mapping[str, Any]) -> None:
    kinds = _check_full_or_shared(text, "index_sharing")
    if kinds is not None and kinds[0] != "full":
        raise ConfigError(f"index_sharing must start with 'full' (vLLM refuses it), got {kinds!r}")


def _check_deepseek_v41(text: Mapping[str, Any]) -> None:
    ratios = _list_of(text, "compress_ratios", int) or []
    if set(ratios) - {0, 1, 2}:
        raise ConfigError(f"compress_ratios must hold 0, 1 or 2 per layer, got {ratios!r}")
    compressed = [i for i, r in enumerate(ratios[: text["num_hidden_layers"]]) if r > 0]
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        sources = _list_of(text, key, int) or []
        if compressed and not any(s <= compressed[0] for s in sources):
            raise ConfigError(
                f"layer {compressed[0]} is compressed but no {key} entry is at or below it "
                f"(got {_describe(text.get(key))}): vLLM refuses the model"
            )
    _whole(text, "candidate_source_layer_id", -1, None)
    _whole(text, "candidate_topk_blocks", 0, None)


def _check_minimax_m3(text: Mapping[str, Any]) -> None:
    for key in ("index_topk_freq", "index_skip_topk_offset"):
        try:  # vLLM reads int(value or default)
            int(text.get(key) or 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a whole number, got {text[key]!r}") from None
    sparse = text.get("sparse_attention_config") or {}
    if not isinstance(sparse, dict) or not isinstance(
        sparse.get("sparse_attention_freq") or [], list
    ):
        raise ConfigError(
            "sparse_attention_config must be a JSON object whose sparse_attention_freq is a "
            f"list, got {_describe(text['sparse_attention_config'])}"
        )


def _check_minimax_m3_layer_types(text: Mapping[str, Any]) -> None:
    _check_minimax_m3(text)
    _list_of(text, "layer_types", str)


_RULE_CHECKS = {
    "dsa": _check_dsa,
    "dsa_indexer_types": _check_dsa_indexer_types,
    "hy_v4": _check_hy_v4,
    "deepseek_v41": _check_deepseek_v41,
    "minimax_m3": _check_minimax_m3,
    "minimax_m3_layer_types": _check_minimax_m3_layer_types,
    "index_sharing": _check_index_sharing,
}


# Rules (vLLM's) ---------------------------------------------------------------


def skip_topk_rule() -> Callable[[Any], set[int]]:
    """vLLM's compute_skip_topk_layers, from where the installed release keeps it."""
    return importlib.import_module(RULES[RELEASE].skip_topk).compute_skip_topk_layers


def leader_mask(config: Mapping[str, Any]) -> list[bool]:
    """True for each decoder layer that computes its own top-k, on the DSA paths that read
    index_topk_freq / index_topk_pattern / index_skip_topk_offset and never indexer_types."""
    pattern = config.get("index_topk_pattern")
    num_layers = config["num_hidden_layers"]
    skip = skip_topk_rule()(
        SimpleNamespace(
            index_topk=config.get("index_topk", 1),
            num_hidden_layers=num_layers,
            index_topk_pattern=pattern,
            # A pattern overrides the frequency, which those paths then never read.
            index_topk_freq=config.get("index_topk_freq", 1) if pattern is None else 1,
            index_skip_topk_offset=config.get("index_skip_topk_offset", 2),
        )
    )
    return [i not in skip for i in range(num_layers)]


def _hy_v4_roles(text: dict) -> tuple[list[int], list[int], list[str]]:
    """HYV4MLAAttention's sparse layers and skip_topk, from vLLM's HYV4Config."""
    from huggingface_hub.errors import StrictDataclassError
    from vllm.transformers_utils.configs.hy_v4 import HYV4Config

    try:
        config = HYV4Config.from_dict(text)
    except (StrictDataclassError, TypeError, ValueError) as e:
        raise ConfigError(f"vLLM's HYV4Config refuses it: {e}") from None
    # Only now: the model code takes twice as long to import as the config class.
    from vllm.models.hy_v4.nvidia.attention import _SPARSE_LAYER_TYPES

    skip = skip_topk_rule()(config)
    kinds = config.layer_types or []
    sparse = [
        i
        for i in range(config.num_hidden_layers)
        if i < len(kinds) and kinds[i] in _SPARSE_LAYER_TYPES
    ]
    notes = []
    if "indexer_types" not in text and {"index_topk_freq", "index_topk_pattern"} & text.keys():
        notes.append(
            "HYV4Config fills in indexer_types (layers 0, 1, 5, 9, ... full), so vLLM "
            "ignores index_topk_freq / index_topk_pattern for this model"
        )
    if not sparse:
        notes.append("no layer_types entry is a sparse attention layer: no layer runs DSA")
    return [i for i in sparse if i not in skip], [i for i in sparse if i in skip], notes


def _deepseek_v41_roles(text: dict) -> tuple[list[int], tuple[tuple[str, int], ...], list[str]]:
    """The layers reading another layer's top-k or candidates, and the buffers
    `deepseek_v41_model` copies for them, by the rule that patch allocates by."""
    from vllm_dsa_dbo.patches.deepseek_v41_model import hand_offs

    reusing, readers = hand_offs(SimpleNamespace(**text))
    buffers = []
    if reusing:
        buffers.append(("top-k buffer", text["index_topk"]))
    notes = []
    if readers:
        buffers.append(("candidate-block buffer", text.get("candidate_topk_blocks", 0)))
        notes.append(
            f"candidate_source_layer_id: the indexers of layers {' '.join(map(str, readers))} "
            f"mask their scores with layer {text['candidate_source_layer_id']}'s candidate blocks"
        )
    return sorted({*reusing, *readers}), tuple(buffers), notes


def _minimax_m3_followers(text: dict) -> list[int]:
    """The layers reusing the previous one's top-k (`skip_index_topk`), by vLLM's rule."""
    from vllm.models.minimax_m3.amd.model import _should_skip_index_topk

    config = SimpleNamespace(**text)
    return [i for i in range(text["num_hidden_layers"]) if _should_skip_index_topk(config, i)]


def _minimax_m3_layer_types_followers(text: dict) -> list[int]:
    """vLLM 0.34.0's `_should_skip_index_topk` on its config class's sparse `layer_types`,
    restated: its module imports vllm.platforms.rocm, which asks a ROCm GPU for its
    architecture at import (a CPU host has none)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import MiniMaxM3VLTextConfig

    try:
        config = MiniMaxM3VLTextConfig.from_dict(text)
    except (StrictDataclassError, TypeError, ValueError) as e:
        raise ConfigError(f"transformers' MiniMaxM3VLTextConfig refuses it: {e}") from None
    freq = int(getattr(config, "index_topk_freq", 1) or 1)
    if not getattr(config, "use_index_cache", False) or freq <= 1:
        return []
    offset = int(getattr(config, "index_skip_topk_offset", 0) or 0)
    sparse = [i for i, kind in enumerate(config.layer_types) if kind == "minimax_m3_sparse"]
    return [i for ordinal, i in enumerate(sparse) if max(ordinal - offset, 0) % freq != 0]


def _indexer_types_mask(text: dict) -> list[bool]:
    """The leaders of a path that calls compute_skip_topk_layers on its whole config."""
    skip = skip_topk_rule()(SimpleNamespace(**text))
    return [i not in skip for i in range(text["num_hidden_layers"])]


def _index_sharing_mask(text: dict) -> list[bool]:
    """Mistral Large 4's layers that run their own indexer, by vLLM's layer specs."""
    from vllm.models.mistral.common.layer_spec import get_layer_specs

    config = SimpleNamespace(
        num_hidden_layers=text["num_hidden_layers"],
        index_topk=text["index_topk"],
        index_sharing=text.get("index_sharing"),
    )
    return [spec.has_indexer for spec in get_layer_specs(config)]


_LEADER_MASKS: dict[str, Callable[[dict], list[bool]]] = {
    "dsa": leader_mask,
    "dsa_indexer_types": _indexer_types_mask,
    "index_sharing": _index_sharing_mask,
}
_FOLLOWERS: dict[str, Callable[[dict], list[int]]] = {
    "minimax_m3": _minimax_m3_followers,
    "minimax_m3_layer_types": _minimax_m3_layer_types_followers,
}


def _dsa_notes(rule: str, text: dict) -> list[str]:
    """What vLLM reads of the index_topk keys on a `dsa` path, where a reader may not expect."""
    num_layers = text["num_hidden_layers"]
    pattern = text.get("index_topk_pattern")
    notes: list[str] = []
    if rule not in ("dsa", "dsa_indexer_types"):
        return notes
    if rule == "dsa_indexer_types" and text.get("indexer_types") is not None:
        ignored = {"index_topk_freq", "index_topk_pattern", "index_skip_topk_offset"} & text.keys()
        if ignored:
            notes.append(f"indexer_types decides: vLLM ignores {' / '.join(sorted(ignored))}")
        return notes
    if rule == "dsa" and text.get("indexer_types") is not None:
        notes.append(
            f"vLLM {VLLM_VERSION} reads no indexer_types on this path: leaders come from "
            "index_topk_freq / index_topk_pattern / index_skip_topk_offset"
        )
    if pattern is not None and len(pattern) < num_layers:
        notes.append(
            f"index_topk_pattern covers {len(pattern)} of {num_layers} layers: "
            "the rest run their own indexer"
        )
    return notes


def layout(path: CodePath, text: dict) -> Layout:
    """`text` (from `check_config`) laid out by vLLM's rule for `path`."""
    num_layers = text["num_hidden_layers"]
    leaders: list[int] | None = None
    followers: list[int] = []
    notes: list[str] = []
    buffers: tuple[tuple[str, int], ...] = ()
    if path.rule in _LEADER_MASKS:
        mask = _LEADER_MASKS[path.rule](text)
        leaders = [i for i, lead in enumerate(mask) if lead]
        followers = [i for i, lead in enumerate(mask) if not lead]
        notes = _dsa_notes(path.rule, text)
    elif path.rule == "hy_v4":
        leaders, followers, notes = _hy_v4_roles(text)
    elif path.rule == "deepseek_v41":
        followers, buffers, notes = _deepseek_v41_roles(text)
    elif path.rule in _FOLLOWERS:
        followers = _FOLLOWERS[path.rule](text)
    if release_of(VLLM_VERSION or "") is None:
        notes.append(f"vLLM {VLLM_VERSION} is none of {SUPPORTED_VLLM}: read by {RELEASE}'s rules")
    if path.kept == GROUPS:
        groups = groups_with_followers([i not in followers for i in range(num_layers)])
    else:
        groups = len(followers)
    return Layout(
        architecture=text["architectures"][0],
        path=path,
        num_layers=num_layers,
        index_topk=text["index_topk"],
        leaders=leaders,
        followers=followers,
        groups_with_followers=groups,
        notes=notes,
        buffers=buffers,
    )


def groups_with_followers(leaders: list[bool]) -> int:
    """Index groups of several layers: a group starts at a leader (or the first layer)."""
    starts = [i for i, leads in enumerate(leaders) if leads or i == 0]
    return sum(end - start > 1 for start, end in zip(starts, [*starts[1:], len(leaders)]))


def ubatch_topk_bytes_per_extra_ubatch(*, max_decode_rows: int, groups_with_followers: int) -> int:
    """Extra bytes per GPU per extra microbatch, as `core.add_layer_state` allocates: per
    group with followers, `max_decode_rows + 1` int32 valid counts (the top-k rows are
    microbatch 0's)."""
    return 4 * groups_with_followers * (max_decode_rows + 1)
