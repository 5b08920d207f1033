"""One engine configuration (DP=2, expert parallel), greedy outputs to JSON.

    python -m dsa_dbo_harness.run --model DIR --mode eager --dbo --out run.json

Two GPUs: one DP rank per GPU. One GPU: both ranks on GPU 0
(`NCCL_MULTI_RANK_GPU_ENABLE=1`); chosen from the visible GPUs, recorded as
`gpu_count`. With a DeepEP all2all backend the harness lifts no vLLM check
(`harness_gates` empty in every worker). The fix is on when vllm-dsa-dbo is
installed, off with VLLM_DSA_DBO_DISABLE=stock (recorded in the JSON either way,
from inside the workers).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import socket
import sys
import time
from pathlib import Path

MODES = {
    # mode: (extra LLM kwargs, extra env)
    "eager": ({"enforce_eager": True}, {}),
    "v2": ({"enforce_eager": True}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    # torch.compile'd (models that support it), no CUDA graphs
    "compiled": ({"compilation_config": {"cudagraph_mode": "NONE"}}, {}),
    "graph": (
        {
            "compilation_config": {
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "cudagraph_capture_sizes": [4, 8, 16, 32],
            }
        },
        {},
    ),
}
MAX_NUM_SEQS = 64  # max_decode_rows = 64: every prompt prefills past it
ALL2ALL = {
    # --all2all: (vLLM backend, harness gates lifted)
    "naive": ("allgather_reducescatter", True),
    "deepep_ht": ("deepep_high_throughput", False),
    "deepep_ll": ("deepep_low_latency", False),
}
# Environment recorded with each run (what changes kernels or placement).
RECORDED_ENV = (
    "VLLM_DBO_COMM_SMS",
    "VLLM_USE_DEEP_GEMM",
    "VLLM_MOE_USE_DEEP_GEMM",
    "VLLM_DSA_DBO_CHECK",
    "VLLM_DSA_DBO_HARNESS_GATES",
    "NCCL_MULTI_RANK_GPU_ENABLE",
    "VLLM_USE_V2_MODEL_RUNNER",
    "NVSHMEM_QP_DEPTH",
)


def engine_kwargs(args) -> dict:
    kwargs = dict(
        # A params.json alone is Mistral's format (Mistral Large 4): vLLM's auto-detection
        # also wants consolidated safetensors, which a dummy load has none of.
        **({"config_format": "mistral"} if (Path(args.model) / "params.json").exists() else {}),
        model=str(args.model),
        load_format="dummy",
        skip_tokenizer_init=True,
        block_size=64,
        max_model_len=4096,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.prefix_caching,
        enable_expert_parallel=True,
        all2all_backend=ALL2ALL[args.all2all][0],
        seed=0,
        **MODES[args.mode][0],
    )
    if args.kv_cache_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if args.attention_backend != "auto":
        kwargs["attention_backend"] = args.attention_backend
    if args.dbo:
        kwargs.update(
            enable_dbo=True,
            dbo_decode_token_threshold=args.dbo_decode_token_threshold,
            dbo_prefill_token_threshold=args.dbo_prefill_token_threshold,
        )
    return kwargs


def prompts_for_rank(rank: int, count: int) -> list[list[int]]:
    """Longer than index_topk (512) and all of different lengths."""
    rnd = random.Random(100 + rank)
    return [[rnd.randrange(2, 2000) for _ in range(600 + 53 * i)] for i in range(count)]


def rank_env(rank: int, args, port: int) -> dict[str, str]:
    """A DP rank's environment; on one GPU both ranks share GPU 0."""
    env = dict(
        VLLM_DP_RANK=str(rank),
        VLLM_DP_RANK_LOCAL=str(rank if args.gpu_count > 1 else 0),
        VLLM_DP_SIZE="2",
        VLLM_DP_MASTER_IP="127.0.0.1",
        VLLM_DP_MASTER_PORT=str(port),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_DSA_DBO_HARNESS_GATES="1" if ALL2ALL[args.all2all][1] else "0",
        **MODES[args.mode][1],
    )
    if args.gpu_count == 1:
        env.update(CUDA_VISIBLE_DEVICES="0", NCCL_MULTI_RANK_GPU_ENABLE="1")
    return env


def rank_main(rank: int, args, port: int, results: mp.Queue) -> None:
    os.environ.update(rank_env(rank, args, port))
    from vllm import LLM, SamplingParams

    from dsa_dbo_harness import start_measuring
    from dsa_dbo_harness.worker_probe import snapshot

    llm = LLM(**engine_kwargs(args))
    before = llm.collective_rpc(snapshot)
    llm.collective_rpc(start_measuring)
    prompts = [{"prompt_token_ids": p} for p in prompts_for_rank(rank, args.prompts)]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0,
        logprobs=1,
        detokenize=False,
        ignore_eos=True,
    )
    start = time.time()
    outputs = llm.generate(prompts, params)
    elapsed = time.time() - start
    after = llm.collective_rpc(snapshot)
    for worker_before, worker_after in zip(before, after):
        worker_after["counts_during_generate"] = {
            k: v - worker_before["counts"].get(k, 0) for k, v in worker_after["counts"].items()
        }
    samples = []
    for output in outputs:
        completion = output.outputs[0]
        samples.append(
            {
                "prompt_len": len(output.prompt_token_ids),
                "tokens": list(completion.token_ids),
                "logprobs": [
                    lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)
                ],
            }
        )
    results.put({"rank": rank, "workers": after, "generate_seconds": elapsed, "samples": samples})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=sorted(MODES), default="eager")
    parser.add_argument("--dbo", action="store_true")
    parser.add_argument("--dbo-decode-token-threshold", type=int, default=4)
    parser.add_argument("--dbo-prefill-token-threshold", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="per DP rank")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--all2all", choices=sorted(ALL2ALL), default="naive")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--attention-backend", default="FLASHMLA_SPARSE", help="'auto': vLLM picks")
    parser.add_argument(
        "--gpu-count",
        type=int,
        choices=(1, 2),
        default=None,
        help="GPUs the two ranks use (default: 2 if two are visible, else 1)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=0,
        help="each rank's KV cache, instead of what vLLM's memory profile leaves: engines "
        "starting side by side on one GPU each count the others' memory as their own",
    )
    parser.add_argument("--timeout", type=float, default=400)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser()
    args = parser.parse_args(argv)
    import torch

    if args.gpu_count is None:
        args.gpu_count = min(torch.cuda.device_count(), 2)
    if args.gpu_count < 1:
        parser.error("no CUDA GPU visible")

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=rank_main, args=(r, args, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    got, deadline = [], time.time() + args.timeout
    while len(got) < 2 and time.time() < deadline:
        try:
            got.append(results.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in ranks):
                break
    for p in ranks:
        p.join(10)
        if p.is_alive():
            p.kill()
    if len(got) < 2:
        print(f"FAILED: {len(got)} of 2 ranks returned", file=sys.stderr)
        return 1
    import vllm

    workers = [w for g in got for w in g["workers"]]
    record = {
        "argv": sys.argv,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine_kwargs": {k: v for k, v in engine_kwargs(args).items() if k != "model"},
        "mode_env": MODES[args.mode][1],
        "gpu_count": args.gpu_count,
        "harness_gates": sorted({gate for w in workers for gate in w["harness_gates"]}),
        "runners": sorted({w["runner"] for w in workers}),
        "attention_backends": sorted({b for w in workers for b in w["attention_backends"]}),
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        "rank0_env": rank_env(0, args, port),
        "fix_disabled_env": os.environ.get("VLLM_DSA_DBO_DISABLE", ""),
        "vllm": vllm.__version__,
        "vllm_path": os.path.dirname(vllm.__file__),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": sorted(got, key=lambda g: g["rank"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record))
    summary = [
        (w["plugin_patched"], w["counts_during_generate"], w["ubatch_topk_bytes"])
        for g in record["ranks"]
        for w in g["workers"]
    ]
    print("WROTE", args.out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
