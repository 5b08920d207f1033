"""The trained checkpoint with an MTP layer (`trained mtp`), read as vLLM's GLM-5 MTP path
reads it, on CPU: the draft's config, the registry entry, and where every weight goes.

A CPU cannot build the CUDA drafter (`vllm.models.deepseek_v32.nvidia.mtp.DeepseekV32MTP`:
sparse MLA backends, DeepGEMM's indexer, fused experts), so its loader's own name mapping
(`get_spec_layer_idx_from_weight_name`, `_rewrite_spec_layer_name`) is run on every name,
and the mapped names are checked against the decoder layer the main model already loads
under the same names, and against the MTP layer's own modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsa_dbo_harness.lookup_task import held_out
from dsa_dbo_harness.trained import IMPLEMENTATION, MTP_FILE, add_mtp, mtp_template_layer, prompt
from vllm_sdist import sha256

MODEL = Path(__file__).parent / "kv_lookup" / "model"


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("mtp") / "model"
    add_mtp(MODEL, dst)
    return dst


def names(path: Path) -> dict[str, list[int]]:
    with safe_open(path, "pt") as weights:
        return {k: list(weights.get_slice(k).get_shape()) for k in weights.keys()}  # noqa: SIM118


def test_the_main_model_is_the_trained_one(with_mtp):
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert sha256(with_mtp / name) == sha256(MODEL / name)
    saved, trained = (json.loads((d / "config.json").read_text()) for d in (with_mtp, MODEL))
    assert saved == {**trained, "num_nextn_predict_layers": 1}
    assert mtp_template_layer(trained) == 6


def test_the_same_command_writes_the_same_layer(tmp_path, with_mtp):
    add_mtp(MODEL, tmp_path)
    assert sha256(tmp_path / MTP_FILE) == sha256(with_mtp / MTP_FILE)


def test_transformers_answers_as_before(with_mtp):
    """The reference answers come from transformers: it reads the main model's file only."""
    from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    ids = tokenizer(prompt(held_out()[0]), return_tensors="pt", add_special_tokens=False)
    logits = []
    for directory in (MODEL, with_mtp):
        model = GlmMoeDsaForCausalLM.from_pretrained(
            directory, dtype=torch.float32, **IMPLEMENTATION
        )
        with torch.no_grad():
            logits.append(model(**ids).logits)
    assert torch.equal(*logits)


def test_vllm_configures_the_glm5_mtp_draft(with_mtp):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.model_executor.models.registry import ModelRegistry

    target = ModelConfig(model=str(with_mtp), max_model_len=1024)
    assert target.architecture == "GlmMoeDsaForCausalLM"
    spec = SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=1,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    draft = spec.draft_model_config
    assert draft.hf_config.architectures == ["DeepseekV32MTPModel"]
    assert draft.hf_config.n_predict == 1 and draft.model == str(with_mtp)
    entry = ModelRegistry.models["DeepseekV32MTPModel"]
    # On CUDA this module exports nvidia.mtp.DeepseekV32MTP (a CPU gets a generic class).
    assert (entry.module_name, entry.class_name) == ("vllm.models.deepseek_v32", "DeepseekV32MTP")


def test_the_mtp_loader_places_every_weight(with_mtp):
    from vllm.config import ModelConfig
    from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name
    from vllm.models.deepseek_v32.nvidia.mtp import DeepseekV32MTP

    config = ModelConfig(model=str(with_mtp), max_model_len=1024).hf_config
    main, mtp = names(with_mtp / "model.safetensors"), names(with_mtp / MTP_FILE)
    # The main model's loader skips the MTP layer's names and keeps its own.
    assert {get_spec_layer_idx_from_weight_name(config, k) for k in main} == {None}
    assert {get_spec_layer_idx_from_weight_name(config, k) for k in mtp} == {8}
    placed = {DeepseekV32MTP._rewrite_spec_layer_name(None, 8, k): v for k, v in mtp.items()}
    block = {
        k.removeprefix("model.layers.8.mtp_block."): v
        for k, v in placed.items()
        if ".mtp_block." in k
    }
    # The MTP block is a DeepseekV32DecoderLayer with an indexer and experts, as layer 6.
    assert block == {
        k.removeprefix("model.layers.6."): v
        for k, v in main.items()
        if k.startswith("model.layers.6.")
    }
    hidden, vocab = config.hidden_size, config.vocab_size
    assert {k: v for k, v in placed.items() if ".mtp_block." not in k} == {
        "model.embed_tokens.weight": [vocab, hidden],
        "model.layers.8.enorm.weight": [hidden],
        "model.layers.8.hnorm.weight": [hidden],
        "model.layers.8.eh_proj.weight": [hidden, 2 * hidden],
        "model.layers.8.shared_head.norm.weight": [hidden],
        "model.layers.8.shared_head.head.weight": [vocab, hidden],
    }


def test_the_mtp_head_is_vllms_shared_head(with_mtp):
    """`shared_head.*` are the parameters of vLLM's own SharedHead at this config."""
    from vllm.config import ModelConfig
    from vllm.model_executor.models.deepseek_mtp import SharedHead

    from vllm_dsa_dbo import cpu_dbo

    config = ModelConfig(model=str(with_mtp), max_model_len=1024).hf_config
    with cpu_dbo.cpu_vllm():
        head = SharedHead(config=config, prefix="model.layers.8.shared_head", quant_config=None)
    built = {f"model.layers.8.shared_head.{k}": list(p.shape) for k, p in head.named_parameters()}
    mtp = names(with_mtp / MTP_FILE)
    assert built == {k: v for k, v in mtp.items() if ".shared_head." in k}
