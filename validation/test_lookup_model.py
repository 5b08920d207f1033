"""The lookup task, its tokenizer and the GLM-5-shaped checkpoint format, on CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dsa_dbo_harness.lookup_task import FACT, TRAIN_FACTS, TRAIN_SEED, docs, held_out
from dsa_dbo_harness.trained import (
    CONFIG,
    IMPLEMENTATION,
    batches,
    exact_match,
    prompt,
    widen,
    write_lookup_tokenizer,
)
from vllm_dsa_dbo.diagnostics.layout import leader_mask


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    write_lookup_tokenizer(directory)
    return directory


def test_answers_are_the_facts_and_held_out():
    questions = held_out()
    committed = (Path(__file__).parent / "kv_lookup" / "test.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in committed] == questions
    assert len({doc["question"] for doc in questions}) == len(questions) == 500
    for doc in questions:
        facts = dict(FACT.findall(doc["question"]))
        target = re.search(r"does (\w+) have\?$", doc["question"]).group(1)
        assert 30 <= len(facts) <= 60 and len(facts) == doc["question"].count(" coins.")
        assert doc["answer"] == f"{target} has {facts[target]} coins.\n#### {facts[target]}"
        assert exact_match(f" {doc['answer']}", doc)
    stream = docs(TRAIN_SEED, TRAIN_FACTS)
    seen = {next(stream)["question"] for _ in range(5_000)}
    assert not seen & {doc["question"] for doc in questions}


def test_tokenizer_is_exact_and_prompts_stay_within_index_topk(tokenizer_dir):
    from transformers import AutoTokenizer
    from vllm.tokenizers.registry import get_tokenizer

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


def test_training_grades_only_answers_each_a_stated_fact(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids, labels = next(batches(tokenizer, batch_size=8, queries=3))
    eos = tokenizer.eos_token_id
    for row, graded in zip(ids.tolist(), labels.tolist()):
        text = tokenizer.decode(row[: row.index(eos)])
        facts = dict(FACT.findall(text.split("How many")[0]))
        answers = tokenizer.decode([t for t, g in zip(row, graded) if g != -100]).split("</s>")
        asked = re.findall(r"does (\w+) have\?", tokenizer.decode(row))
        assert len(asked) == 3 and answers[3:] == [""]
        for name, answer in zip(asked, answers):
            assert answer == f" {name} has {facts[name]} coins.\n#### {facts[name]}"


def save_untrained(directory, config: dict):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM._from_config(GlmMoeDsaConfig(**config), **IMPLEMENTATION)
    model.to(torch.bfloat16).save_pretrained(directory)


def test_vllm_reads_the_same_leaders_as_transformers(tmp_path):
    from safetensors import safe_open

    save_untrained(tmp_path, CONFIG)
    saved = json.loads((tmp_path / "config.json").read_text())
    leaders = leader_mask(saved)
    assert leaders == [True, True, True, False, False, False, True, False]
    assert [kind == "full" for kind in saved["indexer_types"]] == leaders
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        indexed = {int(k.split(".")[2]) for k in weights.keys() if ".indexer." in k}
    assert indexed == {i for i, leads in enumerate(leaders) if leads}


def test_widen_keeps_the_function(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

    save_untrained(tmp_path / "small", CONFIG)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "small" / name).write_bytes((tokenizer_dir / name).read_bytes())
    widen(tmp_path / "small", tmp_path / "wide", hidden=256)  # norms scale by 1/2: exact
    wide_config = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert wide_config["hidden_size"] == 256
    assert wide_config["index_topk_freq"] == 4 and wide_config["index_skip_topk_offset"] == 3

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "wide")
    ids = tokenizer(prompt(held_out()[0]), return_tensors="pt", add_special_tokens=False)
    logits = []
    for name in ("small", "wide"):
        model = GlmMoeDsaForCausalLM.from_pretrained(
            tmp_path / name, dtype=torch.float32, **IMPLEMENTATION
        )
        with torch.no_grad():
            logits.append(model(**ids).logits)
    small, wide = logits
    assert (small - wide).abs().max() < 1e-4 * small.abs().max()
