"""Seconds per training step of the lookup-task model (dsa_dbo_harness.trained), per
transformers experts implementation, batch size and torch determinism, on this machine.

    PYTHONPATH=validation python bench/train_step.py [--steps 5]
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from dsa_dbo_harness.trained import CONFIG, answer_loss, batches, write_lookup_tokenizer


def seconds_per_step(tokenizer, experts: str, batch_size: int, steps: int) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GlmMoeDsaForCausalLM._from_config(
        GlmMoeDsaConfig(**CONFIG), attn_implementation="sdpa", experts_implementation=experts
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(tokenizer, batch_size)
    times = []
    for _ in range(steps + 1):
        ids, labels = (t.to(device) for t in next(data))
        start = time.perf_counter()
        loss, _ = answer_loss(model, ids, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        times.append(time.perf_counter() - start)
        if times[-1] > 10:
            break
    return sorted(times[1:] or times)[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokenizer", default="/tmp/lookup-tokenizer")
    args = parser.parse_args()
    write_lookup_tokenizer(Path(args.tokenizer))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    for deterministic, experts, batch in itertools.product(
        (False, True), ("grouped_mm", "batched_mm", "eager"), (64, 256)
    ):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            s = seconds_per_step(tokenizer, experts, batch, args.steps)
            print(
                f"deterministic={deterministic} experts={experts} batch={batch}: "
                f"{s * 1e3:.0f} ms/step",
                flush=True,
            )
        except Exception as error:  # noqa: BLE001 - a bench row, not a test
            print(
                f"deterministic={deterministic} experts={experts} batch={batch}: "
                f"{type(error).__name__}: {str(error)[:120]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
