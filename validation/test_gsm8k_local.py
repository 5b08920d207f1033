"""The GSM8K-format task and the tokenizer that serve_ab.sh serves the tiny model with.

On CPU, in the README's test command (pyproject's testpaths), beside the harness it tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dsa_dbo_harness.model import CONFIG
from dsa_dbo_harness.serve import task_texts, write_tokenizer

TASK = Path(__file__).resolve().parent / "gsm8k_local"


def read_docs(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def prompts(docs: list[dict[str, str]], shots: list[dict[str, str]]) -> list[str]:
    """lm_eval's layout of gsm8k_local.yaml's prompts, every shot before each question."""
    context = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    return [f"{context}Question: {doc['question']}\nAnswer:" for doc in docs]


def test_answers_are_right():
    for split, count in (("test", 48), ("train", 8)):
        docs = read_docs(TASK / f"{split}.jsonl")
        assert len(docs) == count and len({d["question"] for d in docs}) == count
        for doc in docs:
            steps = re.findall(r"<<([^=]+)=(\d+)>>", doc["answer"])
            assert steps and all(eval(expr) == int(value) for expr, value in steps)
            assert doc["answer"].endswith(f"\n#### {steps[-1][1]}")


def test_tokenizer_loads_decodes_every_id_and_prompts_pass_index_topk(tmp_path):
    from transformers import AutoTokenizer
    from vllm.tokenizers.registry import get_tokenizer

    write_tokenizer(tmp_path, task_texts(TASK))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    served = get_tokenizer(str(tmp_path))
    for tokenizer in (hf, served):
        assert len(tokenizer) == CONFIG["vocab_size"]
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
        assert all(isinstance(tokenizer.decode([i]), str) for i in range(CONFIG["vocab_size"]))
    texts = prompts(read_docs(TASK / "test.jsonl"), read_docs(TASK / "train.jsonl"))
    for text in texts:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert hf.unk_token_id not in ids and hf.decode(ids) == text
        assert len(ids) > CONFIG["index_topk"]
