"""A GSM8K-format task a tiny model answers only by attending across its prompt.

Each question lists 40-80 people (hundreds of tokens), one of whom has coins,
and asks for that one; the answer repeats the fact and ends `#### N`, so
lm_eval's GSM8K filters score it. The value is stated once, anywhere in the
prompt: a layer that attends to the wrong tokens loses it. One value among
names, not a value per name: binding names to values is what a model this
small learns far too slowly (a llama of the same width had not started by
step 275 with three values, and copied the one value perfectly from step 275).

    python -m dsa_dbo_harness.lookup_task validation/kv_lookup   # test.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
# Seeds of the two streams: training never sees the held-out questions' generator.
TRAIN_SEED, TEST_SEED = 0, 1
TEST_SIZE = 500
TEST_FACTS = (40, 80)
TRAIN_FACTS = (2, 80)


def names(count: int = 120) -> list[str]:
    """Two-syllable names, each one word of the task's tokenizer."""
    rng = random.Random("names")
    letters = itertools.product(CONSONANTS.upper(), VOWELS, CONSONANTS, VOWELS)
    pool = ["".join(name) for name in letters]
    return sorted(rng.sample(pool, count))


NAMES = names()
VALUES = range(10, 100)


# A stated fact, as the question writes it.
FACT = re.compile(r"(\w+) has (\d+) coins\.")


def make_doc(rng: random.Random, facts: tuple[int, int] = TEST_FACTS) -> dict:
    people = rng.sample(NAMES, rng.randint(*facts))
    target, value = rng.choice(people), rng.choice(VALUES)
    facts = " ".join(f"{name} has {value if name == target else 'no'} coins." for name in people)
    return {
        "question": f"{facts} How many coins does {target} have?",
        # GSM8K's answer format: the fact again, then `#### value`.
        "answer": f"{target} has {value} coins.\n#### {value}",
    }


def docs(seed: int, facts: tuple[int, int]) -> Iterator[dict]:
    rng = random.Random(seed)
    while True:
        yield make_doc(rng, facts)


def held_out() -> list[dict]:
    stream = docs(TEST_SEED, TEST_FACTS)
    return [next(stream) for _ in range(TEST_SIZE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    directory = parser.parse_args().directory
    directory.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps(doc) for doc in held_out())
    (directory / "test.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
