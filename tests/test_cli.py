"""`vllm-dsa-dbo` status / memory / demo, including bad input."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from importlib.metadata import version
from types import SimpleNamespace

import pytest
import torch.nn as nn

import fresh
import upstream_tree
from vllm_dsa_dbo.cli import main
from vllm_dsa_dbo.cpu_dbo import SharedTopkStack, attention_module
from vllm_dsa_dbo.diagnostics.layout import leader_mask
from vllm_dsa_dbo.diagnostics.startup import ubatch_topk_bytes


def run_here(
    main: Callable[[list[str]], int], args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess:
    """`main(args)` in this process, in the environment `env`, as a process running it
    would exit and print."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as e:  # argparse: --help, bad arguments
                rc = fresh.exit_code(e.code)
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`vllm-dsa-dbo ARGS` in this process, in its environment less vLLM's variables, plus
    `env`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return run_here(main, list(args), {**environ, **env})


# vLLM's model code: what `status --check` imports, and `status` on a release does not.
MODEL_CODE = ("vllm.models.", "vllm.model_executor.models")
GLM = '"architectures": ["GlmMoeDsaForCausalLM"]'
GLM_SIZE = '"num_hidden_layers": 78, "index_topk": 2048'


# A fresh interpreter's import of MODULE is noted and refused: a run that would import it (and
# vLLM, 20 s) fails at once.
REFUSE_IMPORT = """
import sys
tried = []
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == MODULE or name.startswith(MODULE + "."):
            tried.append(name)
            raise ImportError(f"{name}: the test refuses this import")
sys.meta_path.insert(0, Refuse())
from vllm_dsa_dbo.cli import main
try:
    rc = main(sys.argv[1:])
finally:
    print(MODULE, "imported:", bool(tried) or MODULE in sys.modules)
sys.exit(rc)
"""


def cli_without_torch(*args: str, module: str = "torch", **env: str) -> subprocess.CompletedProcess:
    """`vllm-dsa-dbo ARGS`, then whether it tried to import `module` (its last stdout line)."""
    code = f"MODULE = {module!r}\n{REFUSE_IMPORT}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_help_everywhere():
    for args in ([], ["status"], ["memory"], ["demo"]):
        result = cli(*args, "--help")
        assert result.returncode == 0 and "usage: vllm-dsa-dbo" in result.stdout


def test_status_active():
    result = cli("status", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fix active" in result.stdout
    assert "vllm.v1.attention.backends.mla.index_group" in result.stdout
    assert "status: importing vLLM's attention and model code" in result.stderr


def test_status_on_the_release_imports_none_of_vllms_model_code():
    """What made it slow: vLLM's model code, imported to check the patches (`--check`)."""
    code = (
        "import sys\nfrom vllm_dsa_dbo.cli import main\nrc = main(['status'])\n"
        f"print(sorted(m for m in sys.modules if m.startswith({MODEL_CODE!r})))\nsys.exit(rc)\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    result = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fix active" in result.stdout and "status --check" in result.stdout
    assert result.stdout.splitlines()[-1] == "[]"


def test_status_reads_the_version_of_the_vllm_that_imports(tmp_path):
    """A tree of another version over the installed release: the plugin reads
    `vllm.__version__` and patches nothing, so status may not read the wheel's metadata."""
    tree = tmp_path / "vllm"
    tree.mkdir()
    (tree / "_version.py").write_text('__version__ = "0.35.0"\n__version_tuple__ = (0, 35, 0)\n')
    upstream_tree.link_installed(upstream_tree.installed_vllm(), tree)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    result = fresh.python(["-m", "vllm_dsa_dbo.cli", "status"], env)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "vLLM: 0.35.0 (NOT supported;" in result.stdout
    assert "fix NOT active: vLLM 0.35.0 is not a supported release" in result.stdout


def test_status_on_a_vllm_that_does_not_import():
    """The release as published, but `import vllm` fails: as vLLM would, with no plugin."""
    result = cli_without_torch("status", module="vllm.env_override")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    refused = "ImportError: vllm.env_override: the test refuses this import"
    assert f"fix NOT active: vLLM {version('vllm')} does not import ({refused})" in result.stdout


def test_status_check_starts_no_background_build():
    """Importing DeepSeek-V4.1's code starts two kernel builds, each a Python process that
    `status --check` would wait for at exit."""
    code = (
        "import psutil, sys\nfrom vllm_dsa_dbo.cli import main\nrc = main(['status', '--check'])\n"
        "print('children:', len(psutil.Process().children(recursive=True)))\nsys.exit(rc)\n"
    )
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_") and k != "HUMMING_DISABLE_PARALLEL_BUILD"
    }
    result = fresh.python(["-c", code], environ)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "vllm.models.deepseek_v41.attention" in result.stdout
    assert result.stdout.splitlines()[-1] == "children: 0"


def test_status_with_the_fix_off_and_the_checker_on():
    """register() then installs the checker's patches: not "the plugin patches nothing"."""
    result = cli("status", VLLM_DSA_DBO_DISABLE="1", VLLM_DSA_DBO_CHECK="audit")
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "VLLM_DSA_DBO_DISABLE: '1' (fix off, DBO with shared top-k refused; the plugin "
        "installs only the isolation checker's patches)"
    ) in result.stdout
    assert "patches nothing" not in result.stdout
    alone = cli("status", VLLM_DSA_DBO_DISABLE="1")
    assert (
        "VLLM_DSA_DBO_DISABLE: '1' (fix off, DBO with shared top-k refused; the plugin patches "
        "nothing)"
    ) in alone.stdout


# A second general plugin. Its register() runs after the plugin's (it calls it first, as
# vLLM may order them) and wraps the getter the fix set on the sparse MLA impls.
OTHER_PLUGIN = """
import functools

import vllm_dsa_dbo
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer


def register():
    vllm_dsa_dbo.register()
    ours = SharedTopkIndicesBuffer.topk_indices_buffer

    @functools.wraps(ours.fget)
    def theirs(self):
        return ours.fget(self)

    SharedTopkIndicesBuffer.topk_indices_buffer = property(theirs, ours.fset)
"""


def test_status_check_names_another_plugins_wrapper_over_a_patch(tmp_path):
    """status --check loads vLLM's general plugins as a vLLM process does, and names what
    another one set over the fix's patches: the fix is then not known to be in force."""
    plugin = tmp_path / "other_plugin.py"
    plugin.write_text(OTHER_PLUGIN)
    info = tmp_path / "other_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nother = other_plugin:register\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    result = fresh.python(["-m", "vllm_dsa_dbo.cli", "status", "--check"], env)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr[-3000:]
    getter = "vllm.model_executor.layers.attention.sparse_mla_attention.SharedTopkIndicesBuffer"
    line = OTHER_PLUGIN.splitlines().index("    @functools.wraps(ours.fget)") + 1
    named = f"other code wraps {getter}.topk_indices_buffer (by theirs at {plugin}:{line})"
    assert f"{named}, which the plugin set" in out, out
    assert f"fix NOT active: {named}" in out, out


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"VLLM_PLUGINS": "other"}, "VLLM_PLUGINS filters out dsa_dbo"),
        ({"VLLM_DSA_DBO_DISABLE": "1"}, "VLLM_DSA_DBO_DISABLE is set"),
    ],
)
def test_status_inactive(env, reason):
    result = cli("status", **env)
    assert result.returncode == 1
    assert "fix NOT active" in result.stdout and reason in result.stdout


OFF_SPELLINGS = ("", "0", "off", "OFF", "false", "no", "none", " 0 ")


@pytest.mark.parametrize("value", OFF_SPELLINGS)
def test_off_spellings_mean_off(monkeypatch, value):
    from vllm_dsa_dbo.settings import check_mode, disable_mode

    monkeypatch.setenv("VLLM_DSA_DBO_CHECK", value)
    monkeypatch.setenv("VLLM_DSA_DBO_DISABLE", value)
    assert check_mode() is None and disable_mode() is None


@pytest.mark.parametrize(
    "name, value, expected",
    [("VLLM_DSA_DBO_CHECK", v, v.strip().lower()) for v in ("raise", "audit", " Audit ", "RAISE")]
    + [("VLLM_DSA_DBO_DISABLE", v, "refuse") for v in ("1", "true", "yes", "on", "TRUE")]
    + [("VLLM_DSA_DBO_DISABLE", v, "stock") for v in ("stock", " Stock ")]
    + [
        (name, v, None)
        for name in ("VLLM_DSA_DBO_CHECK", "VLLM_DSA_DBO_DISABLE")
        for v in ("bogus", "2", "enable", "raise,audit")
    ]
    + [("VLLM_DSA_DBO_CHECK", v, None) for v in ("1", "on", "yes")],  # which mode?
)
def test_env_values(monkeypatch, name, value, expected):
    """Known values parse; anything else is an EnvValueError naming the value (None here)."""
    from vllm_dsa_dbo.settings import EnvValueError, check_mode, disable_mode

    monkeypatch.setenv(name, value)
    parse = check_mode if name == "VLLM_DSA_DBO_CHECK" else disable_mode
    if expected is None:
        with pytest.raises(EnvValueError, match=f"^{name}={value!r} is not understood: set "):
            parse()
    else:
        assert parse() == expected


def test_status_shows_the_env_switches_spelled_off():
    result = cli("status", VLLM_DSA_DBO_CHECK="off", VLLM_DSA_DBO_DISABLE="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VLLM_DSA_DBO_CHECK: 'off' (isolation checker off)" in result.stdout
    assert "VLLM_DSA_DBO_DISABLE: '0' (fix on)" in result.stdout
    assert "fix active" in result.stdout


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"VLLM_DSA_DBO_CHECK": "bogus"},
            "VLLM_DSA_DBO_CHECK='bogus' is not understood: set raise "
            "or audit to turn the checker on",
        ),
        (
            {"VLLM_DSA_DBO_DISABLE": "maybe"},
            "VLLM_DSA_DBO_DISABLE='maybe' is not understood: "
            "set 1, true, yes, on or stock to turn the fix off",
        ),
    ],
    ids=["check-bogus", "disable-maybe"],
)
def test_status_unknown_env_value_is_an_error(env, message):
    """Not "fix active" and not "not set": one error naming the value and what it may be."""
    result = cli("status", **env)
    assert result.returncode == 2
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert message in error and "Traceback" not in result.stderr
    assert "NOT understood" in result.stdout and "fix active" not in result.stdout


@pytest.mark.parametrize("draft, rows", [(0, 1025), (3, 4097)])
def test_memory_glm53_keeps_only_the_valid_counts(draft, rows):
    """Microbatch 1 reads microbatch 0's top-k rows from its token offset and keeps only its
    valid counts: G x (max_decode_rows + 1), max_decode_rows = min(8192, 1024 x (1 + draft))."""
    flags = ("--preset", "glm-5.3", "--num-speculative-tokens", str(draft))
    report = json.loads(cli("memory", *flags, "--json").stdout)
    assert report["bytes_per_extra_ubatch"] == 19 * rows * 4
    text = cli("memory", *flags).stdout
    assert "logical top-k buffer   microbatch 0's, from the token offset: 0" in text
    assert "physical top-k rows    microbatch 0's, from the token offset: 0" in text
    assert f"1 extra: {19 * rows * 4:,} bytes (0.{1 if draft == 0 else 3} MiB)" in text


def test_status_says_the_retired_layout_switch_is_read_no_more():
    result = cli("status", VLLM_DSA_DBO_LAYOUT="copies")
    assert "VLLM_DSA_DBO_LAYOUT='copies' is no longer read" in result.stdout
    assert "Traceback" not in result.stderr


def test_memory_glm53_is_19_groups_77900_bytes():
    result = cli("memory", "--preset", "glm-5.3", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["groups_with_followers"] == 19
    assert len(report["leaders"]) == 21 and report["followers"] == 57
    assert report["bytes_per_extra_ubatch"] == 77_900
    text = cli("memory", "--preset", "glm-5.3").stdout
    assert "G = 19" in text and "77,900 (0.1 MiB)" in text
    assert f"vLLM {version('vllm')} code path: vllm/models/deepseek_v32/nvidia (cuda)" in text


def followed_groups(stack: SharedTopkStack) -> list:
    """The stack's index groups, once each, that hold per-microbatch state."""
    groups = {id(impl.index_group): impl.index_group for impl in stack.impls}
    return [g for g in groups.values() if g.ubatch_topk_states]


def test_memory_matches_the_builders_allocation(fake_gpu, tmp_path):
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "num_hidden_layers": 11,
        "index_topk": 128,
        "index_topk_freq": 3,
        "index_skip_topk_offset": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # The demo stack's builder: 32 batched tokens, 10 decode rows.
    stack = SharedTopkStack(leader_mask(config), num_ubatches=3)
    followed = followed_groups(stack)
    allocated = ubatch_topk_bytes(followed)
    result = cli(
        "memory",
        "--config",
        str(tmp_path),
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "10",
        "--num-ubatches",
        "3",
        "--json",
    )
    report = json.loads(result.stdout)
    assert report["groups_with_followers"] == len(followed)
    assert report["bytes_total"] == allocated > 0


def test_memory_without_dbo_or_followers_is_zero(tmp_path):
    assert "0 bytes; no DBO" in cli("memory", "--preset", "glm-5.3", "--num-ubatches", "1").stdout
    # DeepSeek-V3.2: freq 1
    config = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "num_hidden_layers": 61,
        "index_topk": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = cli("memory", "--config", str(tmp_path / "config.json"))
    assert result.returncode == 0 and "followers (0, " in result.stdout
    assert "0 bytes; no layer reuses another's top-k" in result.stdout


@pytest.mark.parametrize(
    "content, args, message",
    [
        pytest.param(None, ["--config", "/nonexistent/config.json"], "cannot read", id="missing"),
        ("{not json", [], "is not valid JSON"),
        ("[1, 2]", [], "is not a JSON object"),
        ('{"num_hidden_layers": 4}', [], "architectures must name the model class"),
        (
            '{"architectures": "GlmMoeDsaForCausalLM"}',
            [],
            "architectures must name the model class",
        ),
        (
            '{"architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 4}',
            [],
            "not a DeepSeek Sparse Attention config",
        ),
        (
            f'{{{GLM}, "num_hidden_layers": 0, "index_topk": 64}}',
            [],
            "num_hidden_layers must be a whole number >= 1, got 0",
        ),
        (
            f'{{{GLM}, "num_hidden_layers": 10000000000, "index_topk": 64}}',
            [],
            "num_hidden_layers must be at most 100,000",
        ),
        (
            f'{{{GLM}, "num_hidden_layers": 4, "index_topk": true}}',
            [],
            "index_topk must be a whole number >= 1, got True",
        ),
        (
            f'{{{GLM}, "num_hidden_layers": 4, "index_topk": 64.0}}',
            [],
            "index_topk must be a whole number >= 1, got 64.0",
        ),
        (
            '{"architectures": ["", "GlmMoeDsaForCausalLM"], "num_hidden_layers": 4}',
            [],
            "architectures must name the model class",
        ),
        (f'{{{GLM}, "text_config": null}}', [], "text_config must be a JSON object, got null"),
        (f'{{{GLM}, "text_config": [1]}}', [], "text_config must be a JSON object, got [1]"),
        *[
            pytest.param(f"{{{GLM}, {GLM_SIZE}, {key}}}", [], message, id=key)
            for key, message in [
                ('"index_topk_freq": "4"', "index_topk_freq must be a whole number >= 1, got '4'"),
                # vLLM divides by it (v32) or refuses it (HYV4); never 1 by default.
                ('"index_topk_freq": 0', "index_topk_freq must be a whole number >= 1, got 0"),
                (
                    '"index_topk_freq": null',
                    "index_topk_freq must be a whole number >= 1, got null",
                ),
                ('"index_topk_freq": -4', "index_topk_freq must be a whole number >= 1, got -4"),
                ('"index_topk_freq": 4.5', "index_topk_freq must be a whole number >= 1, got 4.5"),
                *[
                    (
                        f'"index_skip_topk_offset": {offset}',
                        f"index_skip_topk_offset must be a whole number, got {shown}",
                    )
                    for offset, shown in (('"3"', "'3'"), ("null", "null"))
                ],
                *[
                    (
                        f'"index_topk_pattern": {pattern}',
                        "index_topk_pattern must be F (runs the indexer)",
                    )
                    for pattern in ("12345", '"FSX"', '["F", 1]', '{"0": "F"}')
                ],
            ]
        ],
        (
            '{"architectures": ["HYV4ForCausalLM"], "num_hidden_layers": 3, "index_topk": 64, '
            '"indexer_types": ["full", "shared"]}',
            [],
            "indexer_types must hold 'full' or 'shared' for each of the 3 layers",
        ),
        (
            '{"architectures": ["HYV4ForCausalLM"], "num_hidden_layers": 2, "index_topk": 64, '
            '"indexer_types": ["full", "half"]}',
            [],
            "indexer_types must hold 'full' or 'shared'",
        ),
        (
            '{"architectures": ["HYV4ForCausalLM"], "num_hidden_layers": 2, "index_topk": 64, '
            '"layer_types": "sparse"}',
            [],
            "layer_types must be a list of str, got 'sparse'",
        ),
        (
            '{"architectures": ["DeepseekV41ForCausalLM"], "num_hidden_layers": 2, '
            '"index_topk": 64, '
            '"compress_ratios": [1, 4]}',
            [],
            "compress_ratios must hold 0, 1 or 2 per layer",
        ),
        (
            '{"architectures": ["DeepseekV41ForCausalLM"], "num_hidden_layers": 2, '
            '"index_topk": 64, '
            '"compress_ratios": [0, 1], "kv_source_layer_ids": [1], "index_source_layer_ids": [2]}',
            [],
            "layer 1 is compressed but no index_source_layer_ids entry is at or below it",
        ),
        (
            '{"architectures": ["DeepseekV41ForCausalLM"], "num_hidden_layers": 2, '
            '"index_topk": 64, '
            '"candidate_source_layer_id": null}',
            [],
            "candidate_source_layer_id must be a whole number",
        ),
        (
            '{"architectures": ["MiniMaxM3SparseForCausalLM"], "num_hidden_layers": 2, '
            '"index_topk": 64, "index_topk_freq": "four"}',
            ["--platform", "rocm"],
            "index_topk_freq must be a whole number, got 'four'",
        ),
        (
            '{"architectures": ["MiniMaxM3SparseForCausalLM"], "num_hidden_layers": 2, '
            '"index_topk": 64, "sparse_attention_config": [1]}',
            ["--platform", "rocm"],
            "sparse_attention_config must be a JSON object",
        ),
        (b'{"architectures": ["GlmMoeDsaForCausalLM"], "name": "\xe9"}', [], "is not UTF-8 text"),
    ],
)
def test_memory_bad_config(tmp_path, content, args, message):
    """One clear error, exit 2, read before torch or vLLM is imported (fast)."""
    path = tmp_path / "config.json"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        args = ["--config", str(tmp_path), *args]
    result = cli_without_torch("memory", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == "torch imported: False"


def test_memory_folder_without_a_config(tmp_path):
    result = cli_without_torch("memory", "--config", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr == (
        f"error: {tmp_path} holds neither config.json (HF format) nor params.json "
        "(Mistral format)\n"
    )
    assert result.stdout.splitlines()[-1] == "torch imported: False"


@pytest.mark.parametrize(
    "architectures, shown",
    [
        (["FooBarForCausalLM", "GlmMoeDsaForCausalLM"], "(GlmMoeDsaForCausalLM, 8 layers"),
        (["DeepseekV3BidirectionalModel"], "(DeepseekV3BidirectionalModel, 8 layers"),
        (["GlmMoeDsaForSequenceClassification"], "(GlmMoeDsaForSequenceClassification, 8"),
        (["FooBarForCausalLM", "LlamaForCausalLM", "GlmMoeDsaForCausalLM"], "error: Llama"),
        (["LlamaForCausalLM"], "error: LlamaForCausalLM"),
        (["FooBarForCausalLM"], "error: FooBarForCausalLM"),
    ],
    ids=["first-resolvable", "alias", "adapter", "first-not-dsa", "not-dsa", "unknown"],
)
def test_memory_follows_the_architecture_vllm_builds(tmp_path, architectures, shown):
    """vLLM's registry builds the first architecture it resolves (aliases and adapters too)."""
    config = {"architectures": architectures, "num_hidden_layers": 8, "index_topk": 64}
    (tmp_path / "config.json").write_text(json.dumps({**config, "index_topk_freq": 2}))
    result = cli("memory", "--config", str(tmp_path))
    if shown.startswith("error: "):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        [error] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert shown.removeprefix("error: ") in error and "is not a DSA model" in error
    else:
        assert result.returncode == 0, result.stderr
        assert shown in result.stdout and "followers (3" in result.stdout
        assert "extra bytes per GPU per extra microbatch: 12,300 (0.0 MiB)" in result.stdout


def test_memory_stops_at_what_hy_v4s_config_class_refuses_before_its_model_code(tmp_path):
    """HYV4Config refusing the file is known before vLLM's HYV4 model code is imported."""
    (tmp_path / "config.json").write_text(
        '{"architectures": ["HYV4ForCausalLM"], "num_hidden_layers": 8, "index_topk": 64, '
        '"vocab_size": "x"}'
    )
    module = "vllm.models.hy_v4.nvidia.attention"
    result = cli_without_torch("memory", "--config", str(tmp_path), module=module)
    assert result.returncode == 2 and "HYV4Config refuses it" in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == f"{module} imported: False"


def test_memory_for_minimax_m3_on_rocm_runs_on_a_cpu_host(tmp_path):
    """vLLM 0.34.0's ROCm MiniMax-M3 module asks the GPU for its architecture when imported
    (vllm.platforms.rocm): its layout is read without that import, on every release."""
    sparse = {"sparse_attention_config": {"sparse_attention_freq": [0, 1, 1, 1]}}
    text = {"num_hidden_layers": 4, "index_topk": 64, "use_index_cache": True, **sparse}
    layer_types = ["full_attention"] + ["minimax_m3_sparse"] * 3
    config = {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "text_config": {**text, "index_topk_freq": 2, "layer_types": layer_types},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    module = "vllm.platforms.rocm"
    result = cli_without_torch(
        "memory", "--config", str(tmp_path), "--platform", "rocm", module=module
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "followers (1, reading another layer's top-k): 2\n" in result.stdout
    assert "extra memory: none; refused under DBO" in result.stdout
    assert result.stdout.splitlines()[-1] == f"{module} imported: False"


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-num-batched-tokens", "0"),
        ("--max-num-seqs", "-3"),
        ("--num-speculative-tokens", "-1"),
        ("--num-ubatches", "two"),
    ],
)
def test_memory_bad_sizes(flag, value):
    result = cli("memory", "--preset", "glm-5.3", flag, value)
    assert result.returncode == 2
    assert flag in result.stderr


@pytest.fixture
def demo(monkeypatch, capsys, undo_patches) -> Callable[..., subprocess.CompletedProcess]:
    """`vllm-dsa-dbo demo` in this process. Its stock phase imports vLLM as released: a fresh
    interpreter (tests/fresh.py); its fixed phase runs here, where the plugin is applied, and
    what it patches on top (the isolation checker's patches) is undone after it."""
    from vllm_dsa_dbo import cli as command
    from vllm_dsa_dbo import demo as phases

    def run_phase(args: list[str], env: dict[str, str], **_: object) -> subprocess.CompletedProcess:
        assert args[:3] == [sys.executable, "-m", "vllm_dsa_dbo.demo"]
        if args[3:] != ["--phase", "fixed"]:
            return fresh.python(args[1:], env)
        with undo_patches():
            return run_here(phases.main, args[3:], env)

    monkeypatch.setattr(command, "subprocess", SimpleNamespace(run=run_phase))
    for name in [k for k in os.environ if k.startswith("VLLM_")]:
        monkeypatch.delenv(name)

    def run(**env: str) -> subprocess.CompletedProcess:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        rc = command.main(["demo"])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["vllm-dsa-dbo", "demo"], rc, out, err)

    return run


def test_demo_shows_the_corruption_and_the_fix(demo):
    result = demo()
    assert result.returncode == 0, result.stdout + result.stderr
    stock, fixed = result.stdout.split("with vllm-dsa-dbo:", 1)
    released = f"vLLM {version('vllm')} as released"
    assert stock.startswith(f"{released}: leaders [0, 1, 2, 6]\n")
    assert f"{released}: 3 of 16 top-k reads came from the wrong microbatch" in stock
    wrong = re.findall(r"layer (\d) \(follows \d\), microbatch (\d).*\[WRONG\]", stock)
    # Every follower of microbatch 0 after the first yield (layer 3 precedes it).
    assert sorted(wrong) == [("4", "0"), ("5", "0"), ("7", "0")]
    assert "[WRONG]" not in fixed
    assert "0 of 16 top-k reads came from the wrong microbatch" in fixed


def test_demo_with_the_checker_in_both_modes(demo):
    """README's `VLLM_DSA_DBO_CHECK=audit vllm-dsa-dbo demo`, and raise: the checker
    counts (audit) or stops at (raise) stock vLLM's bad reads, and sees none with the fix."""
    audit = demo(VLLM_DSA_DBO_CHECK="audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    stock, fixed = audit.stdout.split("with vllm-dsa-dbo:", 1)
    assert "isolation checker (audit): 12 violations" in stock
    assert "isolation checker (audit): 0 violations" in fixed
    assert audit.stdout.rstrip().endswith("the isolation checker (audit) saw no bad read")

    raised = demo(VLLM_DSA_DBO_CHECK="raise")
    assert raised.returncode == 0, raised.stdout + raised.stderr
    assert "Traceback" not in raised.stderr
    stock, fixed = raised.stdout.split("with vllm-dsa-dbo:", 1)
    assert (
        "isolation checker (raise) stopped the step at the first bad read: logical top-k: "
        "group 2 follower 2 in microbatch 0"
    ) in stock
    assert "0 of 16 top-k reads came from the wrong microbatch" in fixed
    assert "isolation checker (raise): 0 violations" in fixed


def test_demo_refuses_an_unknown_checker_value():
    result = cli("demo", VLLM_DSA_DBO_CHECK="bogus")
    assert result.returncode == 2 and result.stdout == ""
    assert "VLLM_DSA_DBO_CHECK='bogus' is not understood" in result.stderr


# Layer 1 reuses layer 0's top-k.
V41_2 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "num_hidden_layers": 2,
    "index_topk": 64,
    "compress_ratios": [1, 1],
    "kv_source_layer_ids": [0],
    "index_source_layer_ids": [0],
}


@pytest.mark.parametrize(
    "config, args, shown",
    [
        (
            {
                "architectures": ["HYV4ForCausalLM"],
                "num_hidden_layers": 4,
                "index_topk": 64,
                "layer_types": ["deepseek_sparse_attention"] * 4,
                "indexer_types": ["full", "shared", "full", "shared"],
            },
            [],
            "extra memory: 0 bytes; allocated at model load: nothing (followers build private",
        ),
        (V41_2, [], "  top-k buffer           8192 x 64 x 4 = 2,097,152"),
        (V41_2, ["--platform", "rocm"], "extra memory: none; refused under DBO"),
        (
            {
                "architectures": ["DeepseekV32ForCausalLM"],
                "num_hidden_layers": 4,
                "index_topk": 64,
                "index_topk_freq": 2,
            },
            ["--platform", "rocm"],
            "extra memory: 0 bytes; allocated at model load: nothing (followers build private",
        ),
    ],
    ids=["hy-v4", "deepseek-v41", "deepseek-v41-rocm", "rocm-dsa"],
)
def test_memory_command_follows_the_architecture(tmp_path, config, args, shown):
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = cli("memory", "--config", str(tmp_path), *args)
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout


def test_startup_line_names_what_was_allocated(fake_gpu):
    from vllm_dsa_dbo.diagnostics.startup import describe

    stack = SharedTopkStack([True, True, False], num_ubatches=2)
    model = nn.ModuleList([attention_module(impl, stack.buffer) for impl in stack.impls])
    line = describe(model)
    allocated = ubatch_topk_bytes(followed_groups(stack))
    assert allocated == 11 * 4
    assert line is not None
    assert f"2 microbatches, 1 index groups with followers, {allocated:,} bytes" in line
    without = SharedTopkStack([True, True, False], num_ubatches=1)
    assert (
        describe(nn.ModuleList([attention_module(i, without.buffer) for i in without.impls]))
        is None
    )
