"""Other vLLM versions, and the fix turned off: DBO with a shared-top-k DSA model is
refused, at config creation and at model build, and everything else still runs;
`VLLM_DSA_DBO_DISABLE=stock` alone runs stock vLLM, with a warning.

Each case runs in a fresh interpreter with the version faked before
`register()`, and builds vLLM's real `VllmConfig` for a tiny GLM-5-shaped config
on disk, as `vllm serve` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_cross_layer_refusal import MINIMAX_M3_INDEX_CACHE
from test_plugin import PATCHED, run_python
from vllm_dsa_dbo import guard

GLM5_SHAPED = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "index_topk": 64,
    "index_n_heads": 2,
    "index_head_dim": 128,
    "index_topk_freq": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "torch_dtype": "bfloat16",
}

OTHER_VERSION = """
    import logging
    logging.basicConfig(format="%(levelname)s %(name)s %(message)s")
    import vllm
    vllm.__version__ = "0.35.0"
"""
REGISTER = """
    import vllm_dsa_dbo
    vllm_dsa_dbo.register()
"""
BOTH_SEAMS = (
    "vllm.config.VllmConfig.__post_init__ and "
    "vllm.model_executor.model_loader.utils.initialize_model and "
    "vllm.model_executor.model_loader.tensorizer.init_tensorizer_model"
)


def build_configs(*models: str) -> str:
    """Code that builds a VllmConfig per (model folder, DBO) and prints the outcome."""
    return f"""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    for folder, dbo in {models!r}:
        try:
            VllmConfig(
                model_config=ModelConfig(model=folder, skip_tokenizer_init=True),
                parallel_config=ParallelConfig(
                    enable_dbo=dbo, all2all_backend="deepep_low_latency"
                ),
                device_config=DeviceConfig(device="cpu"),
            )
            print("BUILT", folder, dbo)
        except ValueError as e:
            print("REFUSED", folder, dbo, " ".join(str(e).split()))
    """


def model_folders(tmp_path) -> tuple[str, str]:
    """A shared-top-k config (index_topk_freq 2) and a DeepSeek-V3.2-like one."""
    folders = []
    for name, freq in (("shared", 2), ("own", 1)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**GLM5_SHAPED, "index_topk_freq": freq}))
        folders.append(str(folder))
    return folders[0], folders[1]


def test_other_version_refuses_dbo_with_shared_topk_and_runs_the_rest(tmp_path):
    shared, own = model_folders(tmp_path)
    cases = ((shared, True), (shared, False), (own, True))
    result = run_python(OTHER_VERSION, REGISTER, PATCHED, build_configs(*cases), HF_HUB_OFFLINE="1")
    out = result.stdout
    assert "PATCHED False" in out, result.stderr[-3000:]
    refusal = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert len(refusal) == 1 and refusal[0].startswith(f"REFUSED {shared} True"), out
    assert "index_topk_freq > 1" in refusal[0] and "found 0.35.0" in refusal[0]
    assert (
        "Drop --enable-dbo" in refusal[0]
        and "use vLLM 0.33.0 or 0.34.0 with vllm-dsa-dbo" in refusal[0]
    )
    assert "PR #60734 alone fixes only the CUDA deepseek_v32 path" in refusal[0]
    assert f"BUILT {shared} False" in out and f"BUILT {own} True" in out
    assert (
        "WARNING vllm.dsa_dbo vllm-dsa-dbo supports vLLM 0.33.0 and 0.34.0 only, found 0.35.0"
        in (result.stderr)
    )
    assert f"refused (guard at {BOTH_SEAMS})" in result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    status = run_python(
        """
        import sys
        import vllm
        from vllm_dsa_dbo import cli
        vllm.__version__ = "0.35.0"
        sys.exit(cli.main(["status"]))
        """
    )
    assert status.returncode == 1, status.stdout + status.stderr[-3000:]
    assert "0.35.0 (NOT supported" in status.stdout
    assert f"refused at {BOTH_SEAMS}" in status.stdout


def test_status_installs_no_guard():
    """`status` names the guard's seams on another version without patching them."""
    result = run_python(
        """
        import sys
        import vllm
        from vllm.config import VllmConfig
        from vllm.model_executor.model_loader import utils
        from vllm_dsa_dbo import cli
        stock = VllmConfig.__post_init__, utils.initialize_model
        vllm.__version__ = "0.35.0"
        rc = cli.main(["status"])
        print("UNTOUCHED", (VllmConfig.__post_init__, utils.initialize_model) == stock,
              hasattr(vllm, "_vllm_dsa_dbo_guard"))
        sys.exit(rc)
        """
    )
    assert f"refused at {BOTH_SEAMS}" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "UNTOUCHED True False" in result.stdout


def test_guard_falls_back_to_the_model_build_seam():
    result = run_python(
        OTHER_VERSION,
        """
        from vllm.config import VllmConfig
        del VllmConfig.__post_init__
        """,
        REGISTER,
        """
        from vllm.model_executor.model_loader import base_loader, utils
        print("SEAM", utils.initialize_model is base_loader.initialize_model,
              utils.initialize_model.__module__)
        """,
    )
    log = result.stderr + result.stdout
    assert "guard at vllm.model_executor.model_loader.utils.initialize_model" in log, log[-3000:]
    assert "SEAM True vllm_dsa_dbo.guard" in result.stdout


def pickled_dbo_config(model: str) -> str:
    """Code that pickles a DBO config of `model`, made before register(), as `made`, and
    `report_build(build)`, which prints whether building it was refused."""
    return f"""
        import pickle
        from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
        made = pickle.dumps(VllmConfig(
            model_config=ModelConfig(model={model!r}, skip_tokenizer_init=True),
            parallel_config=ParallelConfig(enable_dbo=True, all2all_backend="deepep_low_latency"),
            device_config=DeviceConfig(device="cpu"),
        ))
        def report_build(build):
            try:
                build()
                print("BUILT")
            except Exception as e:
                print("REFUSED" if str(e).startswith("vllm-dsa-dbo:") else "FAILED", e)
        """


def test_other_version_refuses_at_model_build_a_config_made_before_register(tmp_path):
    """A config made before register() (its __post_init__ unguarded) and unpickled in a
    worker is refused when the worker builds the model."""
    shared, _ = model_folders(tmp_path)
    result = run_python(
        OTHER_VERSION,
        pickled_dbo_config(shared),
        REGISTER,
        """
        from vllm.model_executor.model_loader import utils
        report_build(lambda: utils.initialize_model(vllm_config=pickle.loads(made)))
        """,
        HF_HUB_OFFLINE="1",
    )
    assert "REFUSED vllm-dsa-dbo: GlmMoeDsaForCausalLM shares top-k" in result.stdout, (
        result.stdout + result.stderr[-3000:]
    )


@pytest.mark.parametrize(
    "before, env",
    [(OTHER_VERSION, {}), ("", {"VLLM_DSA_DBO_DISABLE": "1"})],
    ids=["other-version", "off-switch"],
)
def test_refusals_hold_for_a_vllm_tensorized_model_of_a_config_made_before_register(
    tmp_path, before, env
):
    """TensorizerLoader builds a vLLM-tensorized model with init_tensorizer_model, not
    initialize_model: a config unpickled in a worker is refused there too."""
    shared, _ = model_folders(tmp_path)
    result = run_python(
        before,
        pickled_dbo_config(shared),
        REGISTER,
        """
        from vllm.model_executor.model_loader import tensorizer, tensorizer_loader
        from vllm.model_executor.model_loader.tensorizer import TensorizerConfig
        build = vars(tensorizer_loader).get("init_tensorizer_model")  # by value in 0.33.0
        print("ALIAS", build in (None, tensorizer.init_tensorizer_model))
        report_build(lambda: tensorizer.init_tensorizer_model(
            tensorizer_config=TensorizerConfig(tensorizer_uri="/nonexistent/model.tensors"),
            vllm_config=pickle.loads(made),
        ))
        """,
        HF_HUB_OFFLINE="1",
        **env,
    )
    assert "REFUSED vllm-dsa-dbo: GlmMoeDsaForCausalLM shares top-k" in result.stdout, (
        result.stdout + result.stderr[-3000:]
    )
    assert "ALIAS True" in result.stdout


@pytest.mark.parametrize(
    "env, built",
    [({"VLLM_DSA_DBO_DISABLE": "1"}, False), ({"VLLM_DSA_DBO_DISABLE": "stock"}, True)],
    ids=["off-keeps-refusals", "stock"],
)
def test_off_switch_keeps_the_refusals_and_stock_is_explicit(tmp_path, env, built):
    shared, own = model_folders(tmp_path)
    result = run_python(
        "import logging\nlogging.basicConfig(level=logging.INFO)\n",
        REGISTER,
        PATCHED,
        build_configs((shared, True), (own, True)),
        HF_HUB_OFFLINE="1",
        **env,
    )
    out, log = result.stdout, result.stderr
    assert "PATCHED False" in out and f"BUILT {own} True" in out, log[-3000:]
    if built:
        assert f"BUILT {shared} True" in out
        assert "WARNING:vllm.dsa_dbo:vllm-dsa-dbo: VLLM_DSA_DBO_DISABLE=stock" in log
        assert "OUTPUTS WILL BE CORRUPTED" in log
    else:
        [refusal] = [line for line in out.splitlines() if line.startswith("REFUSED")] or [out]
        assert refusal.startswith(f"REFUSED {shared} True")
        assert "turned off by VLLM_DSA_DBO_DISABLE, which keeps its refusals" in refusal
        assert "VLLM_DSA_DBO_DISABLE=stock runs stock vLLM" in refusal
        assert "CORRUPTED" not in log


def refused_under_dbo_only(architecture: str, text_config: object, key: str) -> None:
    """The guard refuses `text_config` with DBO, naming `key`, and passes it without."""
    model_config = SimpleNamespace(architecture=architecture, hf_text_config=text_config)
    config = SimpleNamespace(
        model_config=model_config, parallel_config=SimpleNamespace(enable_dbo=True)
    )
    with pytest.raises(ValueError, match=key):
        guard.refuse_unfixed(config, "why.")
    config.parallel_config.enable_dbo = False
    guard.refuse_unfixed(config, "why.")


def test_guard_refuses_minimax_m3_with_index_cache():
    """MiniMax-M3's config has no index_topk; the guard (other versions, or a supported one
    without its load-time check) matches its use_index_cache rule."""
    refused_under_dbo_only(
        "MiniMaxM3SparseForCausalLM",
        MINIMAX_M3_INDEX_CACHE,
        "use_index_cache with index_topk_freq > 1",
    )


def test_failed_registration_never_raises_and_falls_back_to_the_guard(tmp_path):
    shared, own = model_folders(tmp_path)
    result = run_python(
        """
        from vllm_dsa_dbo import patches
        def broken():
            raise ImportError("a vLLM internal moved")
        patches.fix_patches = broken
        """,
        REGISTER,
        build_configs((shared, True), (own, True)),
        HF_HUB_OFFLINE="1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"REFUSED {shared} True" in result.stdout and f"BUILT {own} True" in result.stdout
    log = result.stderr + result.stdout
    assert "registration failed (a vLLM internal moved)" in log
    assert "failed to register on this vLLM" in log


@pytest.mark.parametrize(
    "config, keys",
    [
        ({"index_topk": 64, "index_topk_freq": 4}, ["index_topk_freq > 1"]),
        ({"index_topk": 64, "index_topk_freq": 1}, []),
        ({"index_topk": 64, "index_topk_pattern": "FFSS"}, ["an index_topk_pattern with 'S'"]),
        ({"index_topk": 64, "index_topk_pattern": "FFFF"}, []),
        (
            {"index_topk": 64, "num_hidden_layers": 2, "indexer_types": ["full", "shared"]},
            ["indexer_types with 'shared'"],
        ),
        ({"index_topk": 64, "num_hidden_layers": 2, "indexer_types": ["full", "full"]}, []),
        ({"index_topk": 64, "index_source_layer_ids": [0, 2]}, ["index_source_layer_ids"]),
        ({"index_topk": 64, "candidate_source_layer_id": 3}, ["candidate_source_layer_id"]),
        ({"index_topk": 64, "candidate_source_layer_id": -1}, []),
        ({"index_topk_freq": 4}, []),  # not a DSA model
        (
            {"use_index_cache": True, "index_topk_freq": 4},
            ["use_index_cache with index_topk_freq > 1"],
        ),
        ({"use_index_cache": True, "index_topk_freq": 1}, []),
        ({"use_index_cache": False, "index_topk_freq": 4}, []),
    ],
)
def test_sharing_keys(config, keys):
    assert guard.sharing_keys(SimpleNamespace(**config)) == keys


MISTRAL_SHARING_KEY = "index_sharing with a layer other than 'full'"


def test_guard_refuses_mistral_index_sharing():
    """Mistral Large 4 (vLLM 0.34.0): vLLM's config adapter writes `dsa.sharing` as a per-layer
    `index_sharing` list of "full" / "shared" (tests/test_patch_mistral.py builds it through
    the adapter); a "shared" layer reuses the top-k of the "full" one before it."""
    shared = SimpleNamespace(
        index_topk=64, num_hidden_layers=4, index_sharing=["full", "full", "shared", "shared"]
    )
    assert guard.sharing_keys(shared) == [MISTRAL_SHARING_KEY]
    own = SimpleNamespace(index_topk=64, num_hidden_layers=4, index_sharing=["full"] * 4)
    assert guard.sharing_keys(own) == []
    refused_under_dbo_only("MistralLarge4ForCausalLM", shared, MISTRAL_SHARING_KEY)


ODD_INDEX_SHARING = [
    ["full", "FULL", "full", "full"],
    ["full", "Shared", "Shared", "full"],
    ["full", "full ", "full", "full"],
    ["full", None, "full", "full"],
]


def layers(kinds: list) -> str:
    return ",".join(map(str, kinds))


@pytest.mark.parametrize("index_sharing", ODD_INDEX_SHARING, ids=layers)
@pytest.mark.parametrize("rule", ["vllm", "own"])
def test_guard_refuses_every_index_sharing_value_but_full(monkeypatch, rule, index_sharing):
    """An HF config.json is not validated as a params.json is, and vLLM's layer specs make
    every value other than exactly "full" a follower: the guard (the fix off, other versions)
    refuses each under DBO, by vLLM's rule where this vLLM has it and by its own elsewhere."""
    if rule == "own":
        monkeypatch.setattr(guard, "MISTRAL_LAYER_SPECS", ())
    elif guard.vllm_rule(guard.MISTRAL_LAYER_SPECS) is None:
        pytest.skip("this vLLM has no Mistral Large 4 layer specs")
    config = SimpleNamespace(index_topk=64, num_hidden_layers=4, index_sharing=index_sharing)
    refused_under_dbo_only("MistralLarge4ForCausalLM", config, MISTRAL_SHARING_KEY)


def own_and_vllms(monkeypatch, rule: str, text_config: object) -> tuple[list[str], list[str]]:
    """sharing_keys by the guard's own rule (vLLM's function hidden), then by vLLM's."""
    if guard.vllm_rule(getattr(guard, rule)) is None:
        pytest.skip(f"this vLLM has none of {getattr(guard, rule)}")
    vllms = guard.sharing_keys(text_config)
    monkeypatch.setattr(guard, rule, ())
    return guard.sharing_keys(text_config), vllms


@pytest.mark.parametrize(
    "index_sharing",
    [["full"] * 4, ["full", "full", "shared", "shared"], ["full", "shared", "full", "full"]]
    + ODD_INDEX_SHARING,
    ids=layers,
)
def test_guards_own_index_sharing_rule_is_vllms(monkeypatch, index_sharing):
    """Where a vLLM lacks Mistral's layer specs the guard's own rule stands in; it is vLLM's."""
    config = SimpleNamespace(index_topk=64, num_hidden_layers=4, index_sharing=index_sharing)
    own, vllms = own_and_vllms(monkeypatch, "MISTRAL_LAYER_SPECS", config)
    assert own == vllms == ([] if index_sharing == ["full"] * 4 else [MISTRAL_SHARING_KEY])


@pytest.mark.parametrize(
    "indexer_types",
    [["full"] * 4, ["full", "shared", "full", "shared"], ["full", "FULL", "full", "full"]],
    ids=layers,
)
def test_guards_own_indexer_types_rule_refuses_what_vllms_does(monkeypatch, indexer_types):
    """Where a vLLM lacks compute_skip_topk_layers the guard's own rule stands in: "shared"
    layers follow, and a value vLLM rejects is refused rather than guessed."""
    config = SimpleNamespace(index_topk=64, num_hidden_layers=4, indexer_types=indexer_types)
    own, vllms = own_and_vllms(monkeypatch, "SKIP_TOPK_LAYERS", config)
    expected = [] if indexer_types == ["full"] * 4 else ["indexer_types with 'shared'"]
    assert own == vllms == expected


@pytest.mark.parametrize(
    "pattern, freq, offset",
    [(None, 1, 2), (None, 2, 2), (None, 4, 0), ("FFSS", 1, 2), ("FFFF", 1, 2), ("FSFS", 3, 2)],
)
def test_guards_freq_and_pattern_rule_covers_vllms(pattern, freq, offset):
    """deepseek_v2 reads index_topk_freq / index_topk_pattern inline, as vLLM's
    compute_skip_topk_layers does without indexer_types: wherever that finds a follower,
    the guard refuses."""
    skipped = guard.vllm_rule(guard.SKIP_TOPK_LAYERS)
    config = SimpleNamespace(
        index_topk=64,
        num_hidden_layers=8,
        index_topk_freq=freq,
        index_topk_pattern=pattern,
        index_skip_topk_offset=offset,
    )
    assert bool(skipped(config)) <= bool(guard.sharing_keys(config))


def test_refusals_write_their_remedy_once():
    """Every DBO refusal is built by settings.refusal, so the remedy is written in one place
    (the upstream change holds vLLM's source text, no refusal)."""
    package = Path(guard.__file__).parent
    sources = [p for p in package.rglob("*.py") if "upstream" not in p.relative_to(package).parts]
    assert sum(p.read_text().count("Drop --enable-dbo") for p in sources) == 1
    with pytest.raises(ValueError) as refused:
        guard.refuse_hisparse(
            SimpleNamespace(
                attention_config=SimpleNamespace(hisparse_config=object()),
                parallel_config=SimpleNamespace(enable_dbo=True),
            )
        )
    assert str(refused.value).startswith("vllm-dsa-dbo: HiSparse cannot run with dual batch")
    assert str(refused.value).endswith(
        "Drop --enable-dbo (and --ubatch-size), or turn HiSparse off "
        "(attention_config.hisparse_config)."
    )
