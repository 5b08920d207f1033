"""A GLM-5-shaped checkpoint that knows its answers, trained with transformers.

    python -m dsa_dbo_harness.trained train validation/kv_lookup/model   # on a GPU
    python -m dsa_dbo_harness.trained widen validation/kv_lookup/model /tmp/wide
    python -m dsa_dbo_harness.trained control validation/kv_lookup/model /tmp/freq1
    python -m dsa_dbo_harness.trained mtp /tmp/wide /tmp/wide-mtp
    python -m dsa_dbo_harness.trained answer MODEL OUT.jsonl [--limit N]

`train` fits transformers' own `GlmMoeDsaForCausalLM` to the lookup task
(`lookup_task.py`) and saves it, with its word-level tokenizer, as an ordinary
HF checkpoint. Layout: GLM-5's shared top-k schedule (`index_topk_freq=4`,
`index_skip_topk_offset=3`: layers 0, 1, 2 and 6 lead, 3-5 follow 2 and 7
follows 6), two dense layers, then six MoE layers of 8 experts (4 per rank
over 2 expert-parallel ranks). Prompt plus answer stay under `index_topk`, so
the indexer selects every earlier token: sparse attention is dense attention,
and the indexer, which transformers runs without gradient, needs no training.

The saved model has hidden size 128 so that it fits in the repository (13 MB);
`train` at its defaults took 4 min 50 s on one H200. DeepEP's low-latency
kernels are built for hidden sizes 2048-8192 only, so `widen` writes the same
function at hidden size 2048: zero rows and columns for the new dimensions,
and the hidden-size RMSNorm weights and eps rescaled so that every norm sees
the same mean square.

`control` writes the same weights with `index_topk_freq=1`: every layer runs its
own indexer (the former followers' are new and untrained, which changes nothing
while the indexer selects every token), so no top-k is shared and DBO has
nothing to get wrong.

`mtp` adds one untrained multi-token-prediction layer, where vLLM's GLM-5 MTP path
(`DeepseekV32MTP`, `--speculative-config '{"method": "mtp", ...}'`) loads it:
`num_nextn_predict_layers: 1` in config.json and `model.layers.<num_hidden_layers>.*` in
`mtp.safetensors` beside the model's own file (transformers reads only `model.safetensors`;
vLLM's main model skips those names, its drafter reads only them). Its decoder block has the
shapes of the model's last leader with experts (an indexer, as every MTP layer builds one),
seeded random; its head is the model's final norm and `lm_head`, its embedding the model's.
Greedy speculative decoding keeps the target model's tokens whatever the draft proposes, so
answers must not change; an untrained draft is mostly rejected.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import shutil
from collections import Counter
from pathlib import Path

from dsa_dbo_harness.lookup_task import NAMES, TRAIN_FACTS, TRAIN_SEED, VALUES, docs, held_out

# Words with their leading space, whole numbers, punctuation, whitespace.
PIECE = r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]|\s"
VOCAB_SIZE = 256
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm_eval's GSM8K strict-match filter

CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 2,
    "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,  # FlashMLA's 576-wide latent (with the 64 RoPE dims)
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 64,
    "v_head_dim": 16,
    "index_topk": 512,
    "index_n_heads": 32,  # DeepGEMM's indexer kernels: 32 or 64 heads of 128
    "index_head_dim": 128,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    # transformers' router (sigmoid scores plus a correction bias); vLLM builds it from these two.
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
}
SAVE_EVERY = 100
WIDE_HIDDEN = 2048
# transformers' defaults, named: the fastest GPU step in bench/train_step.py.
IMPLEMENTATION = {"attn_implementation": "sdpa", "experts_implementation": "grouped_mm"}


def prompt(doc: dict) -> str:
    """lm_eval's GSM8K prompt (`doc_to_text`) for the task's yaml."""
    return f"Question: {doc['question']}\nAnswer:"


def write_lookup_tokenizer(directory: Path) -> None:
    """A word-level tokenizer, built locally: every name and value is one word.

    The test questions give the other words; filler words pad it to VOCAB_SIZE ids
    so that every id the model can sample decodes.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    texts = [f"{prompt(doc)} {doc['answer']}" for doc in held_out()[:20]]
    texts.append(" ".join([*NAMES, *map(str, VALUES)]))
    counts = Counter(p for text in texts for p in re.findall(PIECE, text))
    pieces = [*SPECIAL.values(), *sorted(counts, key=lambda p: (-counts[p], p))]
    pieces += [f" w{i}" for i in range(VOCAB_SIZE - len(pieces))]
    tokenizer = Tokenizer(
        models.WordLevel({p: i for i, p in enumerate(pieces)}, SPECIAL["unk_token"])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL.values()))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **SPECIAL,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def batches(tokenizer, batch_size: int):
    """Right-padded (input_ids, labels): the loss is on the answer and its eos only."""
    import torch

    stream = docs(TRAIN_SEED, TRAIN_FACTS)
    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    while True:
        rows = []
        for doc in (next(stream) for _ in range(batch_size)):
            head, tail = encode(prompt(doc)), encode(" " + doc["answer"]) + [eos]
            rows.append((head + tail, [-100] * len(head) + tail))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([i + [eos] * (width - len(i)) for i, _ in rows])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
        yield ids, labels


def answer_loss(model, ids, labels):
    """Next-token cross-entropy over the graded tokens, and the logits it came from."""
    import torch

    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:]), logits


def train(out: Path, steps: int, batch_size: int, lr: float) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    write_lookup_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = GlmMoeDsaForCausalLM._from_config(GlmMoeDsaConfig(**CONFIG), **IMPLEMENTATION)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = steps // 20

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    progress = tqdm(zip(range(1, steps + 1), batches(tokenizer, batch_size)), total=steps)
    for step, (ids, labels) in progress:
        ids, labels = ids.to(device), labels.to(device)
        loss, logits = answer_loss(model, ids, labels)
        targets = labels[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        graded = targets != -100
        correct = (logits.argmax(-1) == targets)[graded].float().mean()
        progress.set_postfix(loss=f"{loss.item():.4f}", token_acc=f"{correct.item():.3f}")
        if step % SAVE_EVERY == 0 or step == steps:  # a run cut short still leaves its last save
            copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)


def widen(src: Path, dst: Path, hidden: int = WIDE_HIDDEN) -> None:
    """`src` at hidden size `hidden`, computing the same function."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    small = GlmMoeDsaForCausalLM.from_pretrained(src, dtype=torch.float32)
    narrow = small.config.hidden_size
    ratio = narrow / hidden
    settings = {**json.loads((src / "config.json").read_text()), "hidden_size": hidden}
    settings["rms_norm_eps"] = small.config.rms_norm_eps * ratio
    wide = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**settings))
    state = wide.state_dict()
    with torch.no_grad():
        for name, value in small.state_dict().items():
            target = torch.zeros_like(state[name])
            if value.shape != target.shape and value.dim() == 1:
                value = value * math.sqrt(ratio)  # an RMSNorm over the hidden size
            target[tuple(slice(0, n) for n in value.shape)] = value
            state[name] = target
    wide.load_state_dict(state)
    wide.to(torch.bfloat16).save_pretrained(dst)
    copy_tokenizer(src, dst)


def control(src: Path, dst: Path) -> None:
    """`src` with `index_topk_freq=1`: an indexer in every layer, the same function."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    settings = {**json.loads((src / "config.json").read_text()), "index_topk_freq": 1}
    settings.pop("indexer_types")  # derived again from the frequency
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**settings))
    trained = GlmMoeDsaForCausalLM.from_pretrained(src).state_dict()
    missing, unexpected = model.load_state_dict(trained, strict=False)
    assert not unexpected and all(".indexer." in name for name in missing), missing
    model.to(torch.bfloat16).save_pretrained(dst)
    copy_tokenizer(src, dst)


MTP_FILE = "mtp.safetensors"
MTP_SEED = 0
MTP_STD = 0.02  # the checkpoint's initializer_range


def mtp_template_layer(config: dict) -> int:
    """The last leader with experts: the decoder block an MTP layer mirrors."""
    kinds = zip(config["indexer_types"], config["mlp_layer_types"])
    return max(i for i, (index, mlp) in enumerate(kinds) if index == "full" and mlp == "sparse")


def _untrained(name: str, like, generator):
    """A seeded stand-in for a trained tensor: norms 1, biases 0, matrices N(0, MTP_STD)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones_like(like)
    if like.dim() < 2:
        return torch.zeros_like(like)
    noise = torch.randn(like.shape, generator=generator, dtype=torch.float32) * MTP_STD
    return noise.to(like.dtype)


def add_mtp(src: Path, dst: Path) -> None:
    """`src` with one untrained MTP layer, as vLLM's GLM-5 MTP path (0.33.0, 0.34.0) loads it."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    layer, template = config["num_hidden_layers"], mtp_template_layer(config)
    weights = load_file(src / "model.safetensors")
    generator = torch.Generator().manual_seed(MTP_SEED)
    hidden = config["hidden_size"]
    dtype = weights["lm_head.weight"].dtype
    mtp = {
        f"model.layers.{layer}.{name.split('.', 3)[3]}": _untrained(name, value, generator)
        for name, value in sorted(weights.items())
        if name.startswith(f"model.layers.{template}.")
    }
    eh_proj = torch.randn(hidden, 2 * hidden, generator=generator) * MTP_STD
    own = {
        "enorm.weight": torch.ones(hidden, dtype=dtype),
        "hnorm.weight": torch.ones(hidden, dtype=dtype),
        "eh_proj.weight": eh_proj.to(dtype),
        "shared_head.norm.weight": weights["model.norm.weight"],
        "shared_head.head.weight": weights["lm_head.weight"],
        "embed_tokens.weight": weights["model.embed_tokens.weight"],
    }
    mtp |= {f"model.layers.{layer}.{name}": value.clone() for name, value in own.items()}
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(mtp, dst / MTP_FILE, metadata={"format": "pt"})
    (dst / "config.json").write_text(
        json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2)
    )


def answer(model_dir: Path, questions: list[dict], batch_size: int = 100) -> list[str]:
    """Greedy completions of the task's prompts by transformers."""
    import torch
    from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **IMPLEMENTATION)
    model.to(device)
    model.eval()
    texts = []
    for start in range(0, len(questions), batch_size):
        chunk = [prompt(doc) for doc in questions[start : start + batch_size]]
        batch = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **batch.to(device),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        width = batch["input_ids"].shape[1]
        texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return texts


def exact_match(completion: str, doc: dict) -> bool:
    """lm_eval's strict-match: the first `#### N` equals the reference's."""
    got, want = ANSWER.search(completion), ANSWER.search(doc["answer"])
    return bool(got) and got.group(1) == want.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("train")
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p = verbs.add_parser("widen")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p = verbs.add_parser("control")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p = verbs.add_parser("mtp")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p = verbs.add_parser("answer")
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    if args.verb == "train":
        train(args.out, args.steps, args.batch_size, args.lr)
    elif args.verb == "widen":
        widen(args.src, args.dst)
    elif args.verb == "control":
        control(args.src, args.dst)
    elif args.verb == "mtp":
        add_mtp(args.src, args.dst)
    else:
        questions = held_out()[: args.limit]
        completions = answer(args.model, questions)
        rows = [
            {"doc_id": i, "completion": c, "exact_match": exact_match(c, doc)}
            for i, (c, doc) in enumerate(zip(completions, questions))
        ]
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
        score = sum(row["exact_match"] for row in rows) / len(rows)
        print(f"exact_match {score:.4f} over {len(rows)} questions")


if __name__ == "__main__":
    main()
