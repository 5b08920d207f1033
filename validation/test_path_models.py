"""The GPU runs of each shared top-k architecture on CPU, as far as they go without a GPU: the
tiny models as vLLM reads their configs, the engine arguments run.py gives vLLM, and the names
run_matrix.sh resolves for them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dsa_dbo_harness import model, run
from vllm_dsa_dbo import guard, patches
from vllm_dsa_dbo.diagnostics import layout
from vllm_dsa_dbo.patches import mistral_attention

HERE = Path(__file__).parent
LEADERS = [0, 1, 2, 6]


def read_config(directory: Path, config_format: str = "auto"):
    from vllm.transformers_utils.config import get_config

    return get_config(str(directory), trust_remote_code=False, config_format=config_format)


@pytest.mark.skipif(
    not patches.matters(mistral_attention.PATCH),
    reason="this vLLM has no Mistral Large 4 (vLLM 0.34.0 added it)",
)
def test_mistral_large4_model_is_read_as_vllm_reads_mistral_params(tmp_path):
    from vllm.models.mistral.common.layer_spec import get_layer_specs

    directory = model.write_mistral_large4_model(tmp_path / "ml4")
    assert sorted(p.name for p in directory.iterdir()) == ["params.json"]
    config = read_config(directory, "mistral")
    assert config.architectures == ["MistralLarge4ForCausalLM"]
    assert config.index_sharing == [
        "full",
        "full",
        "full",
        "shared",
        "shared",
        "shared",
        "full",
        "shared",
    ]
    assert config.hidden_size == 2048
    assert (config.n_group, config.topk_group) == (1, 1)  # what Mistral's MoE reads
    assert (config.index_topk, config.index_n_heads, config.index_head_dim) == (512, 32, 128)
    specs = get_layer_specs(config)
    assert [s.layer_idx for s in specs if s.has_indexer] == LEADERS
    assert [s.layer_idx for s in specs if s.is_moe] == list(range(1, 8))
    assert guard.sharing_keys(config) == ["index_sharing with a layer other than 'full'"]
    laid_out = layout.layout(*layout.check_config(config.to_dict()))
    assert (laid_out.leaders, laid_out.followers) == (LEADERS, [3, 4, 5, 7])
    assert laid_out.groups_with_followers == 2


def test_deepep_models_keep_their_leaders_at_hidden_2048(tmp_path):
    from vllm_dsa_dbo.diagnostics.layout import skip_topk_rule

    dsv2 = read_config(model.write_model(tmp_path / "dsv2", 4, model.deepep(model.DSV2_CONFIG)))
    hy = read_config(model.write_hy_v4_model(tmp_path / "hy", 4, model.deepep(model.HYV4_CONFIG)))
    assert (dsv2.architectures, dsv2.hidden_size) == (["DeepseekV3ForCausalLM"], 2048)
    assert (hy.architectures, hy.hidden_size) == (["HYV4ForCausalLM"], 2048)
    followers = set(range(8)) - set(LEADERS)
    assert set(skip_topk_rule()(dsv2)) == followers
    assert [i for i, t in enumerate(hy.indexer_types) if t == "full"] == [0, 1, 5]


def test_engine_kwargs_read_mistral_params_and_fix_the_kv_cache(tmp_path):
    mistral = model.write_mistral_large4_model(tmp_path / "ml4")
    glm = model.write_model(tmp_path / "glm", 4, model.DEEPEP_CONFIG)
    args = run.arg_parser().parse_args(
        ["--model", str(mistral), "--out", "x.json", "--kv-cache-bytes", str(1 << 30)]
    )
    kwargs = run.engine_kwargs(args)
    assert kwargs["config_format"] == "mistral"
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30
    args = run.arg_parser().parse_args(["--model", str(glm), "--out", "x.json"])
    kwargs = run.engine_kwargs(args)
    assert "config_format" not in kwargs and "kv_cache_memory_bytes" not in kwargs


def resolve(name: str) -> str:
    """run_matrix.sh's spec for NAME, read from the script's own functions."""
    script = (
        'HT="--all2all deepep_ht" LL="--all2all deepep_ll" F8="--kv-cache-dtype fp8" '
        'FEW="--prompts 8"\n'
        + subprocess.run(
            ["sed", "-n", "/^family()/,/^}/p; /^spec()/,/^}/p", str(HERE / "run_matrix.sh")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        + f"spec {name}\n"
    )
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, check=True
    ).stdout.strip()


def device_paths_runs() -> list[str]:
    """The run names device_paths.sh hands run_matrix.sh."""
    text = (HERE / "device_paths.sh").read_text()
    return [
        name
        for names in re.findall(r'^(?:HT|LL)_RUNS="([^"]*)"', text, re.MULTILINE)
        for name in names.split()
    ]


def test_device_paths_runs_resolve_to_each_architecture_in_pairs():
    runs = device_paths_runs()
    assert len(runs) == 14
    assert {r.rsplit("_on_", 1)[0] for r in runs} == {
        "ml4_ht",
        "ml4_ll",
        "dsv2e_ht",
        "dsv2_ht",
        "dsv2_ll",
        "hy_ht",
        "hy_ll",
    }
    assert sorted(r.rsplit("_on_", 1)[1] for r in runs) == ["fix"] * 7 + ["stock"] * 7
    specs = {name: resolve(name).split() for name in runs}
    assert specs["ml4_ht_on_stock"][:4] == ["mistral_large4", "off", "eager", "--dbo"]
    assert specs["ml4_ll_on_fix"][:4] == ["mistral_large4", "on", "graph", "--dbo"]
    assert specs["dsv2_ht_on_fix"][:3] == ["dsv2_deepep", "on", "compiled"]
    assert specs["dsv2e_ht_on_stock"][:3] == ["dsv2_deepep", "off", "eager"]
    assert specs["dsv2_ll_on_stock"][:3] == ["dsv2_deepep", "off", "graph"]
    assert specs["hy_ht_on_fix"][:3] == ["hy_v4_deepep", "on", "eager"]
    assert specs["hy_ll_on_stock"][:3] == ["hy_v4_deepep", "off", "graph"]
    for name, spec in specs.items():
        backend = "deepep_ll" if "_ll_" in name else "deepep_ht"
        assert spec[spec.index("--all2all") + 1] == backend, name
        assert spec[spec.index("--prompts") + 1] == "8", name


def fake_run(patched: bool, violations: int, microbatched: int = 12) -> dict:
    """A run.py record of two ranks, one worker each, as `compare --pairs` reads it."""
    worker = {
        "plugin_patched": patched,
        "counts": {"graph_captures": 4, "graph_replays": 9},
        "counts_during_generate": {"ubatched_calls": microbatched},
        "isolation_check": {"checked_reads": 100, "violations": violations},
    }
    return {
        "fix_disabled_env": "" if patched else "stock",
        "vllm": "0.34.0",
        "runners": ["Model Runner V2"],
        "args": {"mode": "graph", "all2all": "deepep_ll"},
        "attention_backends": ["FLASHMLA_SPARSE/FlashMLASparseImpl"],
        "ranks": [{"workers": [worker]}, {"workers": [worker]}],
    }


def write_pair(directory: Path, prefix: str, stock: dict, fix: dict) -> None:
    import json

    (directory / f"{prefix}_on_stock.json").write_text(json.dumps(stock))
    (directory / f"{prefix}_on_fix.json").write_text(json.dumps(fix))


def test_pairs_hold_only_where_stock_reads_badly_and_the_fix_does_not(tmp_path, capsys):
    import json

    from dsa_dbo_harness import compare

    write_pair(tmp_path, "ml4_ll", fake_run(False, 7), fake_run(True, 0))
    assert compare.main(["--pairs", str(tmp_path)]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["pair"] == "ml4_ll" and row["holds"] is True
    assert row["stock"]["violations"] == 14 and row["fix"]["violations"] == 0
    assert row["fix"]["microbatched"] == [12, 12]
    assert row["fix"]["graph_replays"] == [9, 9]

    write_pair(tmp_path, "hy_ht", fake_run(False, 0), fake_run(True, 0))  # stock saw no bad read
    assert compare.main(["--pairs", str(tmp_path)]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["pair"], r["holds"]) for r in rows] == [("hy_ht", False), ("ml4_ll", True)]

    (tmp_path / "hy_ht_on_stock.json").unlink()
    write_pair(tmp_path, "hy_ht", fake_run(False, 3), fake_run(True, 0, microbatched=0))
    assert compare.main(["--pairs", str(tmp_path)]) == 1  # the fix never microbatched
    (tmp_path / "hy_ht_on_fix.json").unlink()
    assert compare.main(["--pairs", str(tmp_path)]) == 1  # the fix's run is missing
    assert json.loads(capsys.readouterr().out.splitlines()[-2])["fix"] is None

    # In a tree carrying the upstream change the state is vLLM's: the plugin patches no group.
    tree_fix = fake_run(False, 0)
    tree_fix["fix_disabled_env"] = ""
    write_pair(tmp_path, "hy_ht", fake_run(False, 3), tree_fix)
    assert compare.main(["--pairs", str(tmp_path)]) == 0


def test_probe_names_groups_traced_code_reads_as_microbatch_0():
    from types import SimpleNamespace

    from dsa_dbo_harness.worker_probe import traced_as_ubatch0
    from vllm_dsa_dbo.patches import mla

    group = SimpleNamespace()
    group._topk_state = lambda: group
    assert not traced_as_ubatch0(group)
    mla.traced_as_ubatch0(group)
    assert traced_as_ubatch0(group)
    assert group._topk_state() is group
    assert not traced_as_ubatch0(SimpleNamespace())
