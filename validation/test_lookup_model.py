"""The lookup task, its tokenizer and the trained GLM-5-shaped checkpoint, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsa_dbo_harness.lookup_task import FACT, TRAIN_FACTS, TRAIN_SEED, docs, held_out
from dsa_dbo_harness.trained import (
    CONFIG,
    IMPLEMENTATION,
    answer,
    batches,
    control,
    exact_match,
    prompt,
    train,
    widen,
    write_lookup_tokenizer,
)
from vllm_dsa_dbo.diagnostics.layout import leader_mask
from vllm_sdist import sha256

MODEL = Path(__file__).parent / "kv_lookup" / "model"
SAMPLE = held_out()[::25]  # 20 of the 500; all 500 took 9 min here (validation/results)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    write_lookup_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    weights = GlmMoeDsaForCausalLM.from_pretrained(MODEL, dtype=torch.float32, **IMPLEMENTATION)
    return tokenizer, weights.eval()


def test_answers_are_the_facts_and_held_out():
    questions = held_out()
    committed = (MODEL.parent / "test.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in committed] == questions
    assert len({doc["question"] for doc in questions}) == len(questions) == 500
    for doc in questions:
        ((name, value),) = FACT.findall(doc["question"])
        assert 40 <= doc["question"].count(" coins.") <= 80
        assert doc["question"].endswith(f"How many coins does {name} have?")
        assert doc["answer"] == f"{name} has {value} coins.\n#### {value}"
        assert exact_match(f" {doc['answer']}", doc)
    stream = docs(TRAIN_SEED, TRAIN_FACTS)
    seen = {next(stream)["question"] for _ in range(5_000)}
    assert not seen & {doc["question"] for doc in questions}


def test_tokenizer_is_exact_and_prompts_stay_within_index_topk(tokenizer_dir):
    from transformers import AutoTokenizer
    from vllm.tokenizers.registry import get_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):  # the checkpoint's, written again
        assert sha256(tokenizer_dir / name) == sha256(MODEL / name)  # no diff of whole files
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    served = get_tokenizer(str(tokenizer_dir))
    for tokenizer in (hf, served):
        assert len(tokenizer) == CONFIG["vocab_size"]
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    longest = max(held_out(), key=lambda doc: len(doc["question"]))
    lengths = []
    for doc in [*held_out(), longest]:
        text = f"{prompt(doc)} {doc['answer']}"
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert hf.unk_token_id not in ids and hf.decode(ids) == text
        lengths.append(len(ids) + 1)  # and the eos
    # Within index_topk the indexer selects every earlier token: sparse is dense attention.
    assert 200 < max(lengths) <= CONFIG["index_topk"]


def test_training_grades_only_the_answer(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids, labels = next(batches(tokenizer, batch_size=8))
    for row, graded in zip(ids.tolist(), labels.tolist()):
        text = tokenizer.decode(row)
        ((name, value),) = FACT.findall(text.split("Answer:")[0])
        answer_ids = [t for t, g in zip(row, graded) if g != -100]
        assert tokenizer.decode(answer_ids) == f" {name} has {value} coins.\n#### {value}</s>"


def test_the_same_command_trains_the_same_checkpoint(tmp_path):
    try:
        for run in ("a", "b"):
            train(tmp_path / run, steps=2, batch_size=2, lr=1e-3)
    finally:
        torch.use_deterministic_algorithms(False)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert sha256(tmp_path / "a" / name) == sha256(tmp_path / "b" / name)


def test_checkpoint_answers_held_out_questions():
    # One at a time: on a CPU, one padded batch of 20 took twice the CPU (38 against 19 CPU-s).
    completions = answer(MODEL, SAMPLE, batch_size=1)
    assert sum(map(exact_match, completions, SAMPLE)) >= 0.95 * len(SAMPLE)


def value_accuracy(model, blind: tuple[int, ...] = ()) -> float:
    """How often the model says the value after "X has"; `blind` layers see only themselves."""
    tokenizer, weights = model

    def self_only(module, args, kwargs):
        batch, length = kwargs["hidden_states"].shape[:2]
        own = torch.arange(length, dtype=torch.int32).view(1, length, 1)
        kwargs["prev_topk_indices"] = own.expand(batch, -1, -1)
        return args, kwargs

    hooks = [
        weights.model.layers[i].self_attn.register_forward_pre_hook(self_only, with_kwargs=True)
        for i in blind
    ]
    right = 0
    try:
        for doc in SAMPLE:
            ((name, value),) = FACT.findall(doc["question"])
            text = f"{prompt(doc)} {name} has"
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                right += tokenizer.decode(weights(**ids).logits[0, -1].argmax()) == f" {value}"
    finally:
        for hook in hooks:
            hook.remove()
    return right / len(SAMPLE)


def test_the_answer_needs_the_followers_attention(model):
    # The DBO bug gives followers another microbatch's top-k; a follower that sees none of the
    # prompt stands for it here. Followers read only the top-k they are handed.
    followers = [i for i, leads in enumerate(leader_mask(model[1].config.to_dict())) if not leads]
    assert followers == [3, 4, 5, 7]
    assert value_accuracy(model) == 1.0
    assert value_accuracy(model, blind=tuple(followers)) <= 0.2


def test_vllm_reads_the_checkpoint_as_transformers_does():
    from safetensors import safe_open

    saved = json.loads((MODEL / "config.json").read_text())
    assert {k: saved[k] for k in CONFIG} == CONFIG
    leaders = leader_mask(saved)
    assert leaders == [True, True, True, False, False, False, True, False]
    assert [kind == "full" for kind in saved["indexer_types"]] == leaders
    with safe_open(MODEL / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    assert {int(k.split(".")[2]) for k in names if ".indexer." in k} == {
        i for i, leads in enumerate(leaders) if leads
    }
    # vLLM's DeepseekV2MoE gives the router a correction bias only for noaux_tc, and scores
    # with softmax unless told otherwise; transformers' router has the bias and uses sigmoid.
    biased = {int(k.split(".")[2]) for k in names if k.endswith("gate.e_score_correction_bias")}
    assert biased == set(range(saved["first_k_dense_replace"], saved["num_hidden_layers"]))
    assert saved["topk_method"] == "noaux_tc" and saved["scoring_func"] == "sigmoid"


def test_widen_keeps_the_function(tmp_path, model):
    widen(MODEL, tmp_path, hidden=512)  # norms scale by sqrt(128 / 512) = 1/2: exact
    wide_config = json.loads((tmp_path / "config.json").read_text())
    assert wide_config["hidden_size"] == 512
    assert wide_config["index_topk_freq"] == 4 and wide_config["index_skip_topk_offset"] == 3

    from transformers import GlmMoeDsaForCausalLM

    tokenizer, small = model
    wide = GlmMoeDsaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **IMPLEMENTATION)
    ids = tokenizer(prompt(SAMPLE[0]), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        narrow_logits, wide_logits = small(**ids).logits, wide(**ids).logits
    assert (narrow_logits - wide_logits).abs().max() < 1e-4 * narrow_logits.abs().max()


def test_control_shares_no_top_k_and_keeps_the_function(tmp_path, model):
    control(MODEL, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["index_topk_freq"] == 1 and all(leader_mask(saved))
    assert saved["indexer_types"] == ["full"] * saved["num_hidden_layers"]

    from transformers import GlmMoeDsaForCausalLM

    tokenizer, trained = model
    every = GlmMoeDsaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **IMPLEMENTATION)
    ids = tokenizer(prompt(SAMPLE[0]), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        assert torch.equal(trained(**ids).logits, every(**ids).logits)
