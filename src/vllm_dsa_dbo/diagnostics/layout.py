"""For `memory`: which layers of a DSA model lead, which follow, and what the plugin keeps
per DBO microbatch for them, per vLLM 0.33.0 code path.

`check_config` reads only the JSON (no torch, no vLLM) and refuses what vLLM would refuse
or misread; the rules are then vLLM's own functions of the config, and the DeepSeek-V4.1
one the patch allocates by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# What the plugin keeps per extra microbatch on a code path whose layers share top-k.
GROUPS = "logical top-k buffer, and per index group with followers its physical top-k"
LOGICAL = "logical top-k buffer only (followers build private single-layer groups)"
REFUSED = "refused under DBO"
MODEL_WIDE = "each model-wide buffer a layer reads from another (top-k, candidate blocks)"
UNSHARED = "nothing: every sparse layer runs its own indexer"

# No model has more; a bound keeps a mistyped count from running for hours.
MAX_LAYERS = 100_000


class ConfigError(ValueError):
    """A config vLLM would refuse or misread, or one of a model the plugin never touches."""


@dataclass(frozen=True)
class CodePath:
    """The vLLM code that builds an architecture on a platform, and its leader rule."""

    module: str
    rule: str | None  # "dsa", "hy_v4", "deepseek_v41", "minimax_m3"; None: nothing shared
    copies: str


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
CODE_PATHS: dict[str, dict[str, CodePath]] = {
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
PLATFORMS = ("cuda", "rocm")


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
        return self.path.copies == REFUSED and bool(self.followers)


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
        raise ConfigError(
            f"{architecture} is not a DSA model: vLLM 0.33.0 builds no layer that hands "
            "top-k to another for it, and the plugin allocates nothing (the README's "
            "coverage table lists the DSA architectures)"
        )
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


def _check_hy_v4(text: Mapping[str, Any]) -> None:
    _list_of(text, "layer_types", str)
    kinds = _list_of(text, "indexer_types", str)
    if kinds is not None and (
        len(kinds) != text["num_hidden_layers"] or set(kinds) - {"full", "shared"}
    ):
        raise ConfigError(
            "indexer_types must hold 'full' or 'shared' for each of the "
            f"{text['num_hidden_layers']} layers, got {kinds!r}"
        )


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


_RULE_CHECKS = {
    "dsa": _check_dsa,
    "hy_v4": _check_hy_v4,
    "deepseek_v41": _check_deepseek_v41,
    "minimax_m3": _check_minimax_m3,
}


# Rules (vLLM's) ---------------------------------------------------------------


def leader_mask(config: Mapping[str, Any]) -> list[bool]:
    """True for each decoder layer that computes its own top-k, on the DSA paths."""
    from vllm.models.hy_v4.nvidia.attention import compute_skip_topk_layers

    pattern = config.get("index_topk_pattern")
    num_layers = config["num_hidden_layers"]
    skip = compute_skip_topk_layers(
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
    from vllm.models.hy_v4.nvidia.attention import _SPARSE_LAYER_TYPES, compute_skip_topk_layers

    skip = compute_skip_topk_layers(config)
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


def layout(path: CodePath, text: dict) -> Layout:
    """`text` (from `check_config`) laid out by vLLM's rule for `path`."""
    num_layers = text["num_hidden_layers"]
    leaders: list[int] | None = None
    followers: list[int] = []
    notes: list[str] = []
    buffers: tuple[tuple[str, int], ...] = ()
    if path.rule == "dsa":
        mask = leader_mask(text)
        leaders = [i for i, lead in enumerate(mask) if lead]
        followers = [i for i, lead in enumerate(mask) if not lead]
        pattern = text.get("index_topk_pattern")
        if pattern is not None and len(pattern) < num_layers:
            notes.append(
                f"index_topk_pattern covers {len(pattern)} of {num_layers} layers: "
                "the rest run their own indexer"
            )
    elif path.rule == "hy_v4":
        leaders, followers, notes = _hy_v4_roles(text)
    elif path.rule == "deepseek_v41":
        followers, buffers, notes = _deepseek_v41_roles(text)
    elif path.rule == "minimax_m3":
        followers = _minimax_m3_followers(text)
    if path.copies == GROUPS:
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


def ubatch_topk_bytes_per_extra_ubatch(
    *,
    max_num_batched_tokens: int,
    max_decode_rows: int,
    index_topk: int,
    groups_with_followers: int,
    logical_only: bool = False,
) -> int:
    """Extra bytes per GPU per extra microbatch, as `core.add_layer_state` allocates (int32):
    the logical buffer, plus per group with followers `max_decode_rows + 1` physical rows
    and valid counts; `logical_only` (HYV4, ROCm DSA): as `share_ubatch_logical_topk`."""
    if groups_with_followers == 0:
        return 0
    if logical_only:
        return 4 * max_num_batched_tokens * index_topk
    rows = max_decode_rows + 1
    index_bytes = (max_num_batched_tokens + groups_with_followers * rows) * index_topk
    return 4 * (index_bytes + groups_with_followers * rows)
