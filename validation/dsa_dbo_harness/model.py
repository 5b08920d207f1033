"""A checkpoint-free GLM-5-shaped model: 8 layers, DSA with shared top-k.

With `index_topk_freq=4, index_skip_topk_offset=3` layers 0, 1, 2 and 6 lead
and 3, 4, 5 and 7 follow; layers 1-7 are MoE, so DBO yields between every
leader and its followers.

`DEEPEP_CONFIG` is the same model at hidden size 2048, for DeepEP.
`DSV2_CONFIG` is the same model as `DeepseekV3ForCausalLM`, which vLLM
builds with its torch.compile'd deepseek_v2 DSA path (same layers, same
leaders). `HYV4_CONFIG` / `write_hy_v4_model` is the same size for `HYV4ForCausalLM`
(vllm/models/hy_v4/nvidia): 8 sparse-attention layers whose leaders and
followers come from `indexer_types` (vLLM's HYV4Config always fills it, so
`index_topk_freq` alone would be ignored). With freq 4 and HYV4's own layout
(offset 2) layers 0, 1 and 5 lead, 2-4 follow 1 and 6-7 follow 5; layers 1-7
are MoE. iHC, the learnable sink, the SwiGLU clamp, the fp32 head and MTP are
off, so only the plain residual, FlashMLA sparse, DeepGEMM indexer and
unquantized MoE kernels run; the MLA output gate (plain torch unless
VLLM_ENABLE_HPC_OPS=1) stays on.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "mlp_layer_types": ["dense"] + ["sparse"] * 7,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_topk": 512,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "indexer_rope_interleave": True,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 8192,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


# GLM/DeepSeek keys HYV4 does not read (it routes sigmoid over one group itself).
_GLM_ONLY = (
    "architectures",
    "model_type",
    "first_k_dense_replace",
    "moe_layer_freq",
    "index_skip_topk_offset",
    "indexer_rope_interleave",
    "n_group",
    "topk_group",
    "topk_method",
    "scoring_func",
    "rope_theta",
)
HYV4_CONFIG = {
    **{k: v for k, v in CONFIG.items() if k not in _GLM_ONLY},
    "architectures": ["HYV4ForCausalLM"],
    "model_type": "hy_v4",
    "pad_token_id": 1,
    "layer_types": ["deepseek_sparse_attention"] * CONFIG["num_hidden_layers"],
    "index_skip_topk_offset": 2,  # HYV4Config's default indexer_types layout
    "enable_ihc": False,
    "learnable_sink": False,
    "gated_mla": True,
    "gating_type": "elementwise",
    "swiglu_limit": 0.0,
    "enable_lm_head_fp32": False,
}


# The same model as `DeepseekV3ForCausalLM`: vLLM builds it with
# model_executor/models/deepseek_v2.py, torch.compile'd unless enforce_eager.
DSV2_CONFIG = {
    **{k: v for k, v in CONFIG.items() if k != "mlp_layer_types"},
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
}


# DeepEP's low-latency kernels are instantiated for hidden sizes 2048, 2560,
# 3072, 4096, 5120, 6144, 7168 and 8192 only (its SWITCH_HIDDEN), so the DeepEP
# runs use the same model at hidden size 2048.
DEEPEP_CONFIG = {**CONFIG, "hidden_size": 2048}


def deepep(config: dict) -> dict:
    """The same model at hidden size 2048 (DeepEP's low-latency kernels)."""
    return {**config, "hidden_size": DEEPEP_CONFIG["hidden_size"]}


# Mistral Large 4 takes no q-LoRA; its MLA keeps qk_nope + qk_rope = head_dim.
MISTRAL_LARGE4_PARAMS = {
    "dim": 2048,
    "n_layers": CONFIG["num_hidden_layers"],
    "n_heads": 16,
    "n_kv_heads": 16,
    "head_dim": 192,
    "hidden_dim": 2048,
    "norm_eps": 1e-5,
    "vocab_size": CONFIG["vocab_size"],
    "max_position_embeddings": CONFIG["max_position_embeddings"],
    "dtype": "bfloat16",
    "rope_theta": 1000000.0,
    "yarn": {
        "factor": 1.0,
        "original_max_position_embeddings": CONFIG["max_position_embeddings"],
        "beta": 32.0,
        "alpha": 1.0,
        "apply_scale": False,
    },
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "moe": {
        "num_experts": CONFIG["n_routed_experts"],
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "expert_hidden_dim": CONFIG["moe_intermediate_size"],
        "first_k_dense_replace": 1,
        "route_every_n": 1,
        "routed_scale": 1.0,
        # Mistral's MoE asserts ungrouped routing and reads the key, which it does not default.
        "num_expert_groups": 1,
        "num_expert_groups_per_tok": 1,
    },
    "dsa": {
        "topk": CONFIG["index_topk"],
        "n_heads": CONFIG["index_n_heads"],
        "head_dim": CONFIG["index_head_dim"],
        "norm_eps": 1e-6,
        "ssmax_scaling": True,
    },
}


def full_or_shared(num_layers: int, freq: int, offset: int) -> list[str]:
    """vLLM's `compute_skip_topk_layers` rule for freq/offset, per layer "full" (leads) or
    "shared" (follows): HYV4's indexer_types, Mistral's index_sharing."""
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def write_model(directory: Path, index_topk_freq: int, base: dict = CONFIG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {**base, "index_topk_freq": index_topk_freq}
    if config["model_type"] == "hy_v4":
        config["indexer_types"] = full_or_shared(
            config["num_hidden_layers"], index_topk_freq, config["index_skip_topk_offset"]
        )
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def write_hy_v4_model(directory: Path, index_topk_freq: int = 4, base: dict = HYV4_CONFIG) -> Path:
    return write_model(directory, index_topk_freq, base)


def write_mistral_large4_model(directory: Path, index_topk_freq: int = 4) -> Path:
    """params.json with the GLM model's leaders as `dsa.index_sharing` ("full" leads)."""
    directory.mkdir(parents=True, exist_ok=True)
    sharing = full_or_shared(
        MISTRAL_LARGE4_PARAMS["n_layers"], index_topk_freq, CONFIG["index_skip_topk_offset"]
    )
    params = {
        **MISTRAL_LARGE4_PARAMS,
        "dsa": {**MISTRAL_LARGE4_PARAMS["dsa"], "index_sharing": ",".join(sharing)},
    }
    (directory / "params.json").write_text(json.dumps(params, indent=1))
    return directory


def reinit_weights(model) -> int:
    """Seeded N(0, 0.02) matrices, unit norms, zero other vectors.

    `--load-format dummy` fills everything with +-1e-3, which collapses every
    prompt to one repeated token; with these weights attention and the top-k
    selection decide the output. Same seed on every rank and run; applied
    before vLLM post-processes the loaded weights, as a checkpoint would be.
    """
    import torch

    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(1234)
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.dtype.is_floating_point or param.dtype.itemsize < 2:
                continue
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
            count += 1
    return count
