"""On a GPU: DeepSeek-V4.1's top-k and candidate-block hand-offs under DBO,
stock vLLM against the fix, bit for bit.

    python bench/v41_handoff.py [--json OUT.json]

Runs itself twice in subprocesses, stock vLLM (VLLM_DSA_DBO_DISABLE=stock) and
with the fix. Each builds vLLM's CUDA `DeepseekV4Model` (its own __init__,
the decoder layers reduced to their attention state as in
tests/test_patch_deepseek_v41.py: vLLM's `DeepseekV4Indexer` and `SparseAttnIndexer`
on index sources) on the GPU and runs one DBO step (every layer, then a yield,
in each microbatch) in vLLM's microbatch threads on a real CUDA stream, under
`torch.cuda.set_sync_debug_mode("error")` and the torch profiler.

Per layer: an index source's `DeepseekV4Indexer.forward` writes the top-k with
vLLM's own Triton kernel (its short-context fill, from each microbatch's own
positions); `DeepseekV4FlashMLAAttention._sparse_indexer_and_attn` runs its
indexer op's `forward_cuda`, whose kernel (DeepGEMM logits, needing a filled
K cache) is replaced by a device copy that writes the candidate source's
blocks and records a later indexer's; `forward_mqa` (FlashMLA) is replaced by
a device copy of the top-k it would attend over. Every read is compared with
what its source layer wrote in the same microbatch. The fixed run also counts
the device bytes the copies take against `vllm-dsa-dbo memory`'s formula.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__" and "--phase" in sys.argv:
    # Real Triton kernels on the GPU; `--device cpu` (a dry run of this script's
    # logic, no evidence) interprets them, with CPU stand-ins for streams and events.
    on_cpu = "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]
    os.environ["TRITON_INTERPRET"] = "1" if on_cpu else "0"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "" if on_cpu else "0")

import argparse  # noqa: E402
import json  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from types import SimpleNamespace  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Positions of each microbatch's tokens: the fill's rows differ between them.
FIRST_POSITION = (0, 6)


def measure_phase(phase: str, device: str) -> dict:
    import pytest
    import torch
    from torch.profiler import ProfilerActivity, profile

    import vllm_dsa_dbo
    from vllm_dsa_dbo import cpu_dbo

    sys.path.insert(0, str(REPO / "tests"))
    import test_patch_deepseek_v41 as v41

    vllm_dsa_dbo.register()
    on_gpu = device == "cuda"
    result: dict = {"phase": phase, "device": torch.cuda.get_device_name(0) if on_gpu else "cpu"}
    memory = torch.cuda.memory_allocated if on_gpu else lambda: 0
    with (
        cpu_dbo.cpu_vllm() as config,
        pytest.MonkeyPatch.context() as mp,
        nullcontext() if on_gpu else cpu_dbo.fake_streams(),
    ):
        stream = torch.cuda.Stream() if on_gpu else cpu_dbo.FakeStream()
        if not on_gpu:
            mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        models, allocated = {}, {}
        for dbo in (False, True):  # both kept alive while counting
            before = memory()
            with torch.device(device):
                models[dbo] = v41.build_v41_model(mp, config, enable_dbo=dbo)
            allocated[dbo] = memory() - before
        step = Step(models[True], mp, v41, device)
        step.run(stream)  # compiles the Triton fill kernel
        with profile(activities=[ProfilerActivity.CUDA]) if on_gpu else nullcontext() as prof:
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                step.run(stream)
            finally:
                if on_gpu:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()
        tokens = v41.MAX_NUM_BATCHED_TOKENS
        result.update(
            host_syncs=0 if on_gpu else None,  # any sync in the step would have raised
            cuda_kernels_per_step=(
                sum(e.device_type.name == "CUDA" for e in prof.events()) if on_gpu else None
            ),
            reads=len(step.reads),
            wrong_reads=step.wrong_reads(),
            microbatches_wrote_different_state=step.distinct(),
            extra_device_bytes_under_dbo=allocated[True] - allocated[False] if on_gpu else None,
            # max_num_batched_tokens x (index_topk + candidate_topk_blocks) x 4
            fixed_formula_bytes=tokens * (v41.INDEX_TOPK + v41.CANDIDATE_TOPK_BLOCKS) * 4,
        )
    return result


class Step:
    """One DBO step through the model's layers, recording what each wrote and read."""

    def __init__(self, model, mp, v41, device: str) -> None:
        import torch
        from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

        self.v41, self.device = v41, device
        self.attns = [layer.attn for layer in model.layers]
        self.layer_of_ubatch: dict[int, int] = {}
        # (microbatch, layer, "top-k" | "candidates") -> device copy
        self.writes: dict[tuple[int, int, str], torch.Tensor] = {}
        self.reads: dict[tuple[int, int, str], torch.Tensor] = {}
        self.candidates = {
            (u, a.layer_id): v41.candidates_of(u, a.layer_id).to(device)
            for u in range(2)
            for a in self.attns
        }
        self.positions = [
            torch.arange(n, device=device) + first
            for n, first in zip(v41.TOKENS_PER_UBATCH, FIRST_POSITION)
        ]
        mp.setattr(torch.ops.vllm, "sparse_attn_indexer", self._indexer_kernel)
        mp.setattr(
            DeepseekV4FlashMLAAttention,
            "forward_mqa",
            lambda attn, q, kv, positions, output: self._attention_kernel(attn),
        )

    def run(self, stream) -> None:
        from vllm_dsa_dbo import cpu_dbo

        self.writes.clear()
        self.reads.clear()
        cpu_dbo.run_dbo_step(self._ubatch, stream=stream)

    def _here(self) -> tuple[int, int, int]:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id

        ubatch = dbo_current_ubatch_id()
        return ubatch, self.layer_of_ubatch[ubatch], self.v41.TOKENS_PER_UBATCH[ubatch]

    def _indexer_kernel(self, *args, candidate_blocks=None, candidate_write=False, **kwargs):
        """torch.ops.vllm.sparse_attn_indexer's candidate side, as device copies."""
        ubatch, layer, n = self._here()
        if candidate_write:
            candidate_blocks[:n].copy_(self.candidates[ubatch, layer])
            self.writes[ubatch, layer, "candidates"] = candidate_blocks[:n].clone()
        elif candidate_blocks is not None:
            self.reads[ubatch, layer, "candidates"] = candidate_blocks[:n].clone()
        return args[13]

    def _attention_kernel(self, attn) -> None:
        """`forward_mqa`: a copy of the top-k it attends over."""
        ubatch, layer, n = self._here()
        self.reads[ubatch, layer, "top-k"] = attn.topk_indices_buffer[:n].clone()

    def _ubatch(self, ubatch: int) -> None:
        import torch
        from vllm.forward_context import get_forward_context
        from vllm.v1.worker.ubatching import dbo_yield

        n = self.v41.TOKENS_PER_UBATCH[ubatch]
        positions = self.positions[ubatch]
        hidden = torch.zeros(n, 64, device=self.device)
        # What the indexer's short-context test reads from its metadata.
        metadata = SimpleNamespace(max_seq_len=n, num_decode_tokens=0, num_prefill_tokens=n)
        get_forward_context().attn_metadata = {
            a.indexer.k_cache.prefix: metadata for a in self.attns if a.indexer is not None
        }
        for attn in self.attns:
            self.layer_of_ubatch[ubatch] = attn.layer_id
            index_q = None
            if attn.indexer is not None:
                attn.indexer.forward(None, None, None, positions, None)
                self.writes[ubatch, attn.layer_id, "top-k"] = attn.indexer.topk_indices_buffer[
                    :n
                ].clone()
                index_q = hidden
            attn._sparse_indexer_and_attn(
                hidden, index_q, None, hidden, hidden, hidden, positions, hidden
            )
            dbo_yield()

    def wrong_reads(self) -> list[tuple[int, int, str]]:
        """The (microbatch, layer, state) reads that differ from their own source's write."""
        import torch

        wrong = []
        for ubatch in range(2):
            for layer, topk_source, candidate_source in self.v41.READS:
                sources = {"top-k": topk_source, "candidates": candidate_source}
                for kind, source in sources.items():
                    if source is None:
                        continue
                    read = self.reads[ubatch, layer, kind]
                    if not torch.equal(read, self.writes[ubatch, source, kind]):
                        wrong.append((ubatch, layer, kind))
        return wrong

    def distinct(self) -> bool:
        """Whether microbatch 1's writes differ from microbatch 0's rows (else a
        cross read would go unseen)."""
        import torch

        return all(
            not torch.equal(written, self.writes[0, layer, kind][: len(written)])
            for (ubatch, layer, kind), written in self.writes.items()
            if ubatch == 1
        )


def main(argv: list[str] | None = None) -> int:
    from gpu_handoff import run_phases

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase", choices=["stock", "fixed"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.phase:
        print("RESULT " + json.dumps(measure_phase(args.phase, args.device)))
        return 0
    return run_phases(__file__, args.json, ("--device", args.device))


if __name__ == "__main__":
    sys.exit(main())
