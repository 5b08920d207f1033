"""Extra memory per microbatch: exactly what the formula says, 0 without followers; and
`vllm-dsa-dbo memory`, per architecture and platform, what vLLM's code path allocates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm.v1.attention.backends.mla.index_group import (
    SparseMLAIndexGroup,
    SparseMLAIndexGroupBuilder,
)

from test_patch_mistral import PARAMS
from vllm_dsa_dbo.diagnostics import layout as layouts
from vllm_dsa_dbo.diagnostics.layout import (
    CODE_PATHS,
    RELEASE,
    RULES,
    check_config,
    groups_with_followers,
    layout,
    leader_mask,
    skip_topk_rule,
    ubatch_topk_bytes_per_extra_ubatch,
)
from vllm_dsa_dbo.diagnostics.startup import ubatch_topk_bytes
from vllm_dsa_dbo.settings import RELEASES, SUPPORTED_VLLM

MAX_NUM_BATCHED_TOKENS = 96
MAX_DECODE_ROWS = 24
INDEX_TOPK = 256


def glm5_leaders(num_layers: int, freq: int, offset: int) -> list[bool]:
    return leader_mask(
        {"num_hidden_layers": num_layers, "index_topk_freq": freq, "index_skip_topk_offset": offset}
    )


def build(
    leaders: list[bool], num_ubatches: int
) -> tuple[SparseMLAIndexGroupBuilder, list[SparseMLAIndexGroup]]:
    """The builder, and the groups it gave per-microbatch state."""
    buffer = torch.empty(MAX_NUM_BATCHED_TOKENS, INDEX_TOPK, dtype=torch.int32)
    builder = SparseMLAIndexGroupBuilder(buffer, MAX_DECODE_ROWS, num_ubatches=num_ubatches)
    groups = {id(g): g for g, _ in (builder.register_layer(leads) for leads in leaders)}
    return builder, [g for g in groups.values() if g.ubatch_topk_states]


@pytest.mark.parametrize(
    "num_layers, freq, offset, expected_groups",
    [(8, 4, 3, 2), (78, 4, 3, 19), (12, 2, 2, 5), (8, 1, 3, 0)],
)
@pytest.mark.parametrize("num_ubatches", [2, 3])
def test_allocated_bytes_match_formula(
    fake_gpu, num_layers, freq, offset, expected_groups, num_ubatches
):
    """Only each extra microbatch's valid counts: its top-k rows are microbatch 0's."""
    leaders = glm5_leaders(num_layers, freq, offset)
    _, followed = build(leaders, num_ubatches)
    g = len(followed)
    assert g == expected_groups == groups_with_followers(leaders)

    count_bytes = g * (MAX_DECODE_ROWS + 1) * 4
    assert ubatch_topk_bytes(followed) == (num_ubatches - 1) * count_bytes
    assert ubatch_topk_bytes(followed) == (num_ubatches - 1) * ubatch_topk_bytes_per_extra_ubatch(
        max_decode_rows=MAX_DECODE_ROWS, groups_with_followers=g
    )


def test_glm53_geometry_is_77900_bytes():
    per_ubatch = ubatch_topk_bytes_per_extra_ubatch(max_decode_rows=1024, groups_with_followers=19)
    assert per_ubatch == 19 * 1025 * 4 == 77_900


def test_no_dbo_allocates_nothing(fake_gpu):
    builder, followed = build(glm5_leaders(78, 4, 3), num_ubatches=1)
    assert followed == []
    assert not builder.ubatch_logical_topk.followed


def test_bad_num_ubatches_is_refused(fake_gpu):
    with pytest.raises(ValueError, match="num_ubatches must be >= 1"):
        build([True], num_ubatches=0)


# `vllm-dsa-dbo memory` per architecture and platform ----------------------------


def memory_report(capsys, config: dict, *args: str, name: str = "config.json") -> dict:
    """`vllm-dsa-dbo memory --json` for `config` as a model folder's file `name`, in this
    process (vLLM already imported)."""
    import tempfile

    from vllm_dsa_dbo.cli import main

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / name).write_text(json.dumps(config))
        capsys.readouterr()
        assert main(["memory", "--config", folder, "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)


def test_memory_is_what_hy_v4_allocates(fake_gpu, monkeypatch, capsys):
    """HYV4 on CUDA: followers in private groups read the logical buffer at their token offset:
    nothing allocated, as the real model allocates."""
    from test_patch_hy_v4 import HF_CONFIG, LEADERS, MAX_NUM_BATCHED_TOKENS, build_hyv4_model
    from vllm_dsa_dbo.diagnostics.refusals import index_groups

    model = build_hyv4_model(monkeypatch, fake_gpu, enable_dbo=True)
    allocated = ubatch_topk_bytes(index_groups(model))
    report = memory_report(
        capsys,
        {**HF_CONFIG, "architectures": ["HYV4ForCausalLM"]},
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
    )
    assert report["leaders"] == [i for i, lead in enumerate(LEADERS) if lead]
    assert report["followers"] and report["bytes_total"] == allocated == 0


def test_memory_is_what_rocm_dsa_allocates(fake_gpu, monkeypatch, capsys):
    """GLM-5 / DeepSeek-V3.2 on ROCm: private groups, nothing allocated, as vLLM's ROCm model
    builds them; on CUDA the group with followers keeps its valid counts."""
    from test_patch_rocm_dsa import LEADERS, MAX_NUM_BATCHED_TOKENS, build_rocm_dsa_model, hf_config
    from vllm_dsa_dbo.diagnostics.refusals import index_groups

    model = build_rocm_dsa_model(monkeypatch, fake_gpu, enable_dbo=True)
    allocated = ubatch_topk_bytes(index_groups(model))
    hf = hf_config()
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "num_hidden_layers": hf.num_hidden_layers,
        "index_topk": hf.index_topk,
        "index_topk_freq": hf.index_topk_freq,
    }
    tokens = ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    report = memory_report(capsys, config, "--platform", "rocm", *tokens)
    assert report["leaders"] == [i for i, lead in enumerate(LEADERS) if lead]
    assert report["followers"] and report["bytes_total"] == allocated == 0
    on_cuda = memory_report(capsys, config, *tokens)["bytes_total"]
    assert on_cuda == ubatch_topk_bytes_per_extra_ubatch(
        max_decode_rows=MAX_NUM_BATCHED_TOKENS, groups_with_followers=1
    )


GLM5_8 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "num_hidden_layers": 8,
    "index_topk": 64,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
}
DSV3_8 = {**GLM5_8, "architectures": ["DeepseekV3ForCausalLM"]}
HYV4_8 = {
    "architectures": ["HYV4ForCausalLM"],
    "model_type": "hy_v4",
    "num_hidden_layers": 8,
    "index_topk": 64,
    "layer_types": ["deepseek_sparse_attention"] * 8,
    "indexer_types": ["full", "full", "shared", "shared", "shared", "full", "shared", "full"],
}
V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "num_hidden_layers": 4,
    "index_topk": 64,
    "compress_ratios": [0, 1, 1, 2],
    "kv_source_layer_ids": [1],
}
MINIMAX_M3 = {
    "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
    "text_config": {
        "num_hidden_layers": 4,
        "index_topk": 64,
        "use_index_cache": True,
        "index_topk_freq": 2,
        "sparse_attention_config": {"sparse_attention_freq": [0, 1, 1, 1]},
    },
}
TOPK_BUFFER_BYTES = 8192 * 64 * 4


@pytest.mark.parametrize(
    "config, platform, followers, verdict, total",
    [
        (GLM5_8, "rocm", 4, "allocated at model load: nothing (followers build private", 0),
        (DSV3_8, "cuda", 4, "allocated at model load: per index group with followers", None),
        (DSV3_8, "rocm", 4, "refused under DBO", None),
        ({**DSV3_8, "index_topk_freq": 1}, "rocm", 0, "no layer reuses another's top-k", 0),
        ({**GLM5_8, "index_topk_pattern": "FFSSFS"}, "cuda", 3, "allocated", None),
        (HYV4_8, "cuda", 4, "allocated at model load: nothing (followers build private", 0),
        (HYV4_8, "rocm", 4, "refused under DBO", None),
        ({**HYV4_8, "layer_types": ["full_attention"] * 8}, "cuda", 0, "no layer reuses", 0),
        (
            {**V41, "index_source_layer_ids": [1]},
            "cuda",
            2,
            "allocated at model load: a copy of each model-wide buffer",
            TOPK_BUFFER_BYTES,
        ),  # layers 2 and 3 reuse 1's top-k
        ({**V41, "index_source_layer_ids": [1]}, "rocm", 2, "refused under DBO", None),
        ({**V41, "index_source_layer_ids": [1, 2, 3]}, "cuda", 0, "no layer reuses", 0),
        ({**V41, "index_source_layer_ids": [1, 2, 3]}, "rocm", 0, "no layer reuses", 0),
        (
            {
                **V41,
                "index_source_layer_ids": [1, 2, 3],
                "candidate_source_layer_id": 1,
                "candidate_topk_blocks": 8,
            },
            "cuda",
            2,
            "allocated",
            8192 * 8 * 4,
        ),
        (
            {
                **V41,
                "index_source_layer_ids": [1, 2, 3],
                "candidate_source_layer_id": 1,
                "candidate_topk_blocks": 8,
            },
            "rocm",
            2,
            "refused under DBO",
            None,
        ),
        # No candidate buffer without candidate_topk_blocks: nothing to copy.
        pytest.param(
            {**V41, "index_source_layer_ids": [1, 2, 3], "candidate_source_layer_id": 1},
            "cuda",
            0,
            "no layer reuses",
            0,
            id="v41-no-candidate-blocks",
        ),
        (MINIMAX_M3, "rocm", 1, "refused under DBO", None),  # layer 2 reuses layer 1's
        (MINIMAX_M3, "cuda", 0, "nothing: every sparse layer runs its own indexer", 0),
        (
            {**MINIMAX_M3, "text_config": {**MINIMAX_M3["text_config"], "use_index_cache": False}},
            "rocm",
            0,
            "no layer reuses",
            0,
        ),
        ({**GLM5_8, "architectures": ["Glm5NextForCausalLM"]}, "cuda", 0, "nothing: every", 0),
    ],
)
def test_memory_follows_the_architecture(capsys, config, platform, followers, verdict, total):
    """Which layers reuse top-k and what it costs come from the code path vLLM builds."""
    report = memory_report(capsys, config, "--platform", platform)
    assert report["followers"] == followers and report["verdict"].startswith(verdict)
    if verdict == "refused under DBO":
        assert report["bytes_total"] is None
        assert (
            memory_report(capsys, config, "--platform", platform, "--num-ubatches", "1")[
                "bytes_total"
            ]
            == 0
        )
    elif total is not None:
        assert report["bytes_total"] == total
    else:  # a shared builder: each followed group's valid counts
        assert (
            report["bytes_total"]
            == ubatch_topk_bytes_per_extra_ubatch(
                max_decode_rows=1024, groups_with_followers=report["groups_with_followers"]
            )
            > 0
        )


def test_memory_notes_what_vllm_ignores(capsys):
    hy_v4 = {**HYV4_8, "index_topk_freq": 2}
    del hy_v4["indexer_types"]
    report = memory_report(capsys, hy_v4)
    # HYV4Config's own indexer_types, not index_topk_freq 2.
    assert report["leaders"] == [0, 1, 5] and "ignores index_topk_freq" in report["notes"][0]
    short = memory_report(capsys, {**GLM5_8, "index_topk_pattern": "FFFS"})
    assert short["leaders"] == [0, 1, 2, 4, 5, 6, 7]
    assert short["notes"] == [
        "index_topk_pattern covers 4 of 8 layers: the rest run their own indexer"
    ]


def test_memory_reports_what_vllms_config_class_refuses(capsys, tmp_path):
    from vllm_dsa_dbo.cli import main

    (tmp_path / "config.json").write_text(json.dumps({**HYV4_8, "vocab_size": "x"}))
    assert main(["memory", "--config", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "vLLM's HYV4Config refuses it: Validation error for field 'vocab_size'" in error


def test_every_dsa_class_is_registered_under_its_own_name():
    """`built_class` skips vLLM's registry for a first architecture that is a DSA class."""
    from vllm.model_executor.models.registry import ModelRegistry

    from vllm_dsa_dbo.diagnostics.layout import CODE_PATHS

    assert {name: ModelRegistry.models[name].class_name for name in CODE_PATHS} == {
        name: name for name in CODE_PATHS
    }


def test_each_release_names_where_it_defines_compute_skip_topk_layers():
    """vLLM's own helper, from the module that defines it in the installed release."""
    assert set(RULES) == set(RELEASES)
    assert skip_topk_rule().__module__ == RULES[RELEASE].skip_topk


# Leaders 0 2 5 6 by indexer_types; 0 1 2 6 by index_topk_freq 4, offset 3.
GLM5_INDEXER_TYPES = {
    **GLM5_8,
    "indexer_types": ["full", "shared", "full", "shared", "shared", "full", "full", "shared"],
}
BY_TYPES, BY_FREQ = [0, 2, 5, 6], [0, 1, 2, 6]


@pytest.mark.parametrize(
    "architecture, platform, leaders",
    [
        ("GlmMoeDsaForCausalLM", "cuda", {"0.33.0": BY_FREQ, "0.34.0": BY_TYPES}),
        ("DeepseekV32ForCausalLM", "rocm", {"0.33.0": BY_FREQ, "0.34.0": BY_TYPES}),
        # The deepseek_v2 path keeps its own rule, which reads no indexer_types.
        ("DeepseekV3ForCausalLM", "cuda", {"0.33.0": BY_FREQ, "0.34.0": BY_FREQ}),
    ],
)
def test_indexer_types_lead_where_the_release_reads_them(capsys, architecture, platform, leaders):
    config = {**GLM5_INDEXER_TYPES, "architectures": [architecture]}
    report = memory_report(capsys, config, "--platform", platform)
    assert report["leaders"] == leaders[RELEASE]
    [note] = report["notes"]
    if leaders[RELEASE] == BY_TYPES:
        assert (
            note == "indexer_types decides: vLLM ignores index_skip_topk_offset / index_topk_freq"
        )
    else:
        assert note.endswith(
            "reads no indexer_types on this path: leaders come from "
            "index_topk_freq / index_topk_pattern / index_skip_topk_offset"
        )


@pytest.mark.skipif(
    CODE_PATHS["GlmMoeDsaForCausalLM"]["cuda"].rule != "dsa_indexer_types",
    reason="this release's GLM-5 path reads no indexer_types",
)
def test_indexer_types_are_checked_where_read(capsys, tmp_path):
    from vllm_dsa_dbo.cli import main

    (tmp_path / "config.json").write_text(json.dumps({**GLM5_8, "indexer_types": ["full"] * 2}))
    assert main(["memory", "--config", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "indexer_types must hold 'full' or 'shared' for each of the 8 layers" in error


# Layers 1-3 sparse by sparse_attention_freq, 0-2 by layer_types.
MINIMAX_M3_TYPED = {
    **MINIMAX_M3,
    "text_config": {
        **MINIMAX_M3["text_config"],
        "layer_types": ["minimax_m3_sparse"] * 3 + ["full_attention"],
    },
}


@pytest.mark.parametrize(
    "config, followers",
    [
        # 0.34.0's config class derives layer_types from sparse_attention_freq.
        (MINIMAX_M3, {"0.33.0": [2], "0.34.0": [2]}),
        (MINIMAX_M3_TYPED, {"0.33.0": [2], "0.34.0": [1]}),
    ],
)
def test_minimax_m3_rocm_sparse_layers_are_the_releases(config, followers):
    assert layout(*check_config(config, "rocm")).followers == followers[RELEASE]


def minimax_m3_configs() -> list[dict]:
    sparse = ["minimax_m3_sparse"]
    kinds = [sparse * 6, ["full_attention"] * 2 + sparse * 4, (sparse + ["full_attention"]) * 3]
    return [
        {"num_hidden_layers": 6, "index_topk": 64, "layer_types": layer_types, **keys}
        for layer_types in kinds
        for keys in (
            {"use_index_cache": True, "index_topk_freq": 2},
            {"use_index_cache": True, "index_topk_freq": 3, "index_skip_topk_offset": 1},
            {"use_index_cache": True, "index_topk_freq": None, "index_skip_topk_offset": 1},
            {"use_index_cache": False, "index_topk_freq": 2},
            {"index_topk_freq": 2},
        )
    ]


@pytest.mark.skipif(
    CODE_PATHS["MiniMaxM3SparseForCausalLM"]["rocm"].rule != "minimax_m3_layer_types",
    reason="this release's rule is vLLM's, imported",
)
def test_minimax_m3_restated_rule_is_vllms():
    """The restated rule gives what vLLM's own `_should_skip_index_topk` gives (imported here
    with the GPU's architecture faked) on the config class the release builds."""
    from transformers import MiniMaxM3VLTextConfig

    from test_cross_layer_refusal import import_rocm_module

    skips = import_rocm_module("vllm.models.minimax_m3.amd.model")._should_skip_index_topk
    for text in minimax_m3_configs():
        config = MiniMaxM3VLTextConfig.from_dict(text)
        expected = [i for i in range(6) if skips(config, i)]
        architecture = {"architectures": ["MiniMaxM3SparseForCausalLM"]}
        assert layout(*check_config({**architecture, **text}, "rocm")).followers == expected, text


MISTRAL_LARGE4 = {
    "architectures": ["MistralLarge4ForCausalLM"],
    "num_hidden_layers": 8,
    "index_topk": 64,
    "index_sharing": ["full", "shared", "shared", "full", "shared", "full", "full", "shared"],
}


@pytest.mark.skipif("MistralLarge4ForCausalLM" not in CODE_PATHS, reason="new in vLLM 0.34.0")
def test_mistral_large4_leaders_are_its_full_layers(capsys):
    report = memory_report(capsys, MISTRAL_LARGE4)
    assert report["leaders"] == [0, 3, 5, 6] and report["followers"] == 4
    assert report["bytes_total"] == ubatch_topk_bytes_per_extra_ubatch(
        max_decode_rows=1024, groups_with_followers=3
    )
    assert memory_report(capsys, MISTRAL_LARGE4, "--platform", "rocm")["bytes_total"] is None
    every_layer = memory_report(capsys, {**MISTRAL_LARGE4, "index_sharing": None})
    assert every_layer["followers"] == 0 and every_layer["bytes_total"] == 0


# Mistral Large 4 as its Mistral-format folder's params.json: vLLM repeats `sharing` over the
# layers, as in MISTRAL_LARGE4_REPEATED.
MISTRAL_LARGE4_PARAMS = {
    **PARAMS,
    "n_layers": 8,
    "dsa": {**PARAMS["dsa"], "topk": 64, "sharing": "full,shared,shared"},
}
MISTRAL_LARGE4_REPEATED = {
    **MISTRAL_LARGE4,
    "index_sharing": ["full", "shared", "shared", "full", "shared", "shared", "full", "shared"],
}


@pytest.mark.skipif("MistralLarge4ForCausalLM" not in CODE_PATHS, reason="new in vLLM 0.34.0")
def test_mistral_format_folder_is_read_as_its_hf_config(capsys):
    mistral = memory_report(capsys, MISTRAL_LARGE4_PARAMS, name="params.json")
    hf = memory_report(capsys, MISTRAL_LARGE4_REPEATED)
    assert mistral.pop("model").endswith("params.json") and hf.pop("model").endswith("config.json")
    assert mistral == hf
    assert mistral["leaders"] == [0, 3, 6] and mistral["groups_with_followers"] == 3


@pytest.mark.skipif("MistralLarge4ForCausalLM" not in CODE_PATHS, reason="new in vLLM 0.34.0")
def test_a_folder_with_both_configs_is_read_as_vllm_picks(capsys, tmp_path):
    """vLLM's config_format "auto": params.json only beside consolidated*.safetensors."""
    from vllm_dsa_dbo.cli import main

    def read(*weights: str) -> str:
        folder = tmp_path / "-".join(weights)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(MISTRAL_LARGE4))
        (folder / "params.json").write_text(json.dumps(MISTRAL_LARGE4_PARAMS))
        for name in weights:
            (folder / name).touch()
        assert main(["memory", "--config", str(folder), "--json"]) == 0
        return Path(json.loads(capsys.readouterr().out)["model"]).name

    assert read("model.safetensors") == "config.json"
    assert read("consolidated-00001-of-00002.safetensors", "model.safetensors") == "params.json"


@pytest.mark.skipif("MistralLarge4ForCausalLM" not in CODE_PATHS, reason="new in vLLM 0.34.0")
def test_what_vllms_mistral_parser_refuses_is_one_line(capsys, tmp_path):
    from vllm_dsa_dbo.cli import main

    dsa = {**MISTRAL_LARGE4_PARAMS["dsa"], "window": 128}
    (tmp_path / "params.json").write_text(json.dumps({**MISTRAL_LARGE4_PARAMS, "dsa": dsa}))
    assert main(["memory", "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(
        "params.json: vLLM's Mistral config parser refuses it: "
        "AssertionError(\"Unparsed dsa config: {'window': 128}\")\n"
    )


@pytest.mark.skipif("MistralLarge4ForCausalLM" in CODE_PATHS, reason="this vLLM builds it")
@pytest.mark.parametrize(
    "name, config",
    [("config.json", MISTRAL_LARGE4), ("params.json", MISTRAL_LARGE4_PARAMS)],
)
def test_mistral_large4_is_named_as_a_later_releases_model(capsys, tmp_path, name, config):
    from vllm_dsa_dbo.cli import main

    (tmp_path / name).write_text(json.dumps(config))
    assert main(["memory", "--config", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert (
        f"error: {tmp_path / name}: MistralLarge4ForCausalLM is new in vLLM 0.34.0: the "
        "installed vLLM"
    ) in error
    assert "Traceback" not in error


def test_memory_on_another_vllm_says_whose_rules_it_reads(capsys, monkeypatch):
    monkeypatch.setattr(layouts, "VLLM_VERSION", "0.35.0")
    assert memory_report(capsys, GLM5_8)["notes"] == [
        f"vLLM 0.35.0 is none of {SUPPORTED_VLLM}: read by {RELEASE}'s rules"
    ]


def converts_per_layer(
    num_scheduled_tokens: list[int], per_seq: int, rows: int, decodes_only: bool
) -> list[int]:
    """The microbatches of a step, split as vLLM splits it, that convert per layer because
    their rows run past a group's `rows + 1` converted rows from their token offset, where
    from row 0 they would fit. A request of at most `per_seq` tokens decodes; `decodes_only`:
    the backend converts only a microbatch of decodes through its group (SM90's FlashMLA and
    FlashAttention MLA sparse)."""
    import numpy as np
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

    tokens = np.array(num_scheduled_tokens)
    _, slices = maybe_create_ubatch_slices(True, tokens, int(tokens.sum()), len(tokens), 2)
    past = []
    for ubatch, s in enumerate(slices):
        decode = all(t <= per_seq for t in tokens[s.request_slice])
        offset, n = s.token_slice.start, s.token_slice.stop - s.token_slice.start
        if (decode or not decodes_only) and n <= rows + 1 < offset + n:
            past.append(ubatch)
    return past


@pytest.mark.parametrize("draft", [0, 3])
def test_glm53_steps_that_convert_per_layer(draft):
    """At GLM-5.3's serving settings (8192 batched tokens, 1024 sequences), as OPERATORS.md
    states: decode steps never; on SM90's backends no undivided step; on backends converting
    mixed batches through their group, the mixed steps of R + 2 to 2 (R + 1) tokens."""
    per_seq = 1 + draft
    rows = min(8192, 1024 * per_seq)
    for seqs in range(2, 1025):
        assert converts_per_layer([per_seq] * seqs, per_seq, rows, decodes_only=False) == []
    mixed_past = set()
    for decodes in (0, 1, 64, 1000):
        for prefill in range(per_seq + 1, 8193 - decodes * per_seq, 13):
            step = [per_seq] * decodes + [prefill]
            assert converts_per_layer(step, per_seq, rows, decodes_only=True) == []
            if converts_per_layer(step, per_seq, rows, decodes_only=False):
                mixed_past.add(sum(step))
    assert min(mixed_past) >= rows + 2 and max(mixed_past) <= 2 * (rows + 1)
