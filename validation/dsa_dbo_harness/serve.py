"""A model folder for `vllm serve` and lm_eval: the harness config plus a tokenizer.

    python -m dsa_dbo_harness.serve MODEL_DIR validation/gsm8k_local

Nothing can be downloaded on the GPU machine and the weights are random, so
the tokenizer only has to load offline and be exact: word level over the
task's own text (words with their leading space, single digits, punctuation,
whitespace), padded with filler words to the model's vocab_size so that
every id the model can sample decodes.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from dsa_dbo_harness.model import CONFIG, write_model

PIECE = r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|\s"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def task_texts(task_dir: Path) -> list[str]:
    """Every question and answer as the task's prompts show them."""
    texts = []
    for path in sorted(task_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            texts.append(f"Question: {doc['question']}\nAnswer: {doc['answer']}\n\n")
    return texts


def write_tokenizer(
    directory: Path,
    texts: Iterable[str],
    vocab_size: int = CONFIG["vocab_size"],
    piece: str = PIECE,
) -> Path:
    """tokenizer.json + tokenizer_config.json with exactly `vocab_size` ids."""
    counts = Counter(p for text in texts for p in re.findall(piece, text))
    pieces = [*SPECIAL.values(), *sorted(counts, key=lambda p: (-counts[p], p))]
    if len(pieces) > vocab_size:
        raise ValueError(f"{len(pieces)} distinct pieces do not fit a vocabulary of {vocab_size}")
    pieces += [f" w{i}" for i in range(vocab_size - len(pieces))]
    tokenizer = Tokenizer(
        models.WordLevel({p: i for i, p in enumerate(pieces)}, SPECIAL["unk_token"])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(piece), behavior="isolated")
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
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("task_dir", type=Path, help="folder of GSM8K-format *.jsonl")
    parser.add_argument("--index-topk-freq", type=int, default=4)
    args = parser.parse_args(argv)
    write_model(args.model_dir, args.index_topk_freq)
    write_tokenizer(args.model_dir, task_texts(args.task_dir))
    print("WROTE", args.model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
