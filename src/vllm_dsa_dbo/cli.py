"""`vllm-dsa-dbo`: is the fix active, what does it cost, what does it fix."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

from vllm_dsa_dbo import DISABLE_ENV, SUPPORTED_VLLM, disabled_by_env, is_supported_vllm
from vllm_dsa_dbo.layout import groups_with_followers, leader_mask

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "dsa_dbo"

GLM53 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "num_hidden_layers": 78,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
}
PRESETS = {"glm-5.3": GLM53}


class UsageError(Exception):
    """Bad input: printed as `error: ...`, exit status 2."""


def whole_number(minimum: int):
    """An argparse type: an integer of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


# status ---------------------------------------------------------------------


def status(args: argparse.Namespace) -> int:
    problems = []
    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        vllm_version = None
    if vllm_version is None:
        problems.append("vLLM is not installed")
        print(f"vLLM: not installed (supported: {SUPPORTED_VLLM})")
    else:
        ok = is_supported_vllm(vllm_version)
        print(f"vLLM: {vllm_version} ({'supported' if ok else 'NOT supported'}; this plugin supports {SUPPORTED_VLLM})")
        if not ok:
            problems.append(f"vLLM {vllm_version} is not {SUPPORTED_VLLM}: the plugin patches nothing")

    found = [e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == ENTRY_POINT_NAME]
    if found:
        print(f"entry point: {ENTRY_POINT_NAME} -> {found[0].value} ({ENTRY_POINT_GROUP})")
    else:
        print(f"entry point: {ENTRY_POINT_NAME} NOT found in {ENTRY_POINT_GROUP}")
        problems.append("the plugin's entry point is not installed in this environment")

    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None:
        print("VLLM_PLUGINS: not set (vLLM loads every plugin)")
    elif ENTRY_POINT_NAME in allowed.split(","):
        print(f"VLLM_PLUGINS: {allowed!r} (includes {ENTRY_POINT_NAME})")
    else:
        print(f"VLLM_PLUGINS: {allowed!r} (does NOT include {ENTRY_POINT_NAME})")
        problems.append(f"VLLM_PLUGINS filters out {ENTRY_POINT_NAME}")

    if disabled_by_env():
        print(f"{DISABLE_ENV}: set, the plugin patches nothing")
        problems.append(f"{DISABLE_ENV} is set")
    else:
        print(f"{DISABLE_ENV}: not set")

    from vllm_dsa_dbo.patches import patch_modules

    print("patches:")
    for module in patch_modules():
        patch = module.PATCH
        print(f"  {patch.target}\n    how: {patch.how}\n    remove when: {patch.remove_when}")

    if problems:
        print("fix NOT active: " + "; ".join(problems))
        return 1
    print("fix active: vLLM will apply it in every process")
    return 0


# memory ---------------------------------------------------------------------


def load_config(args: argparse.Namespace) -> tuple[str, dict]:
    if args.preset:
        return f"preset {args.preset}", PRESETS[args.preset]
    path = Path(args.config)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a JSON object")
    config = config.get("text_config", config)
    if "index_topk" not in config:
        raise UsageError(
            f"{path} is not a DeepSeek Sparse Attention config (no index_topk): "
            "the plugin allocates nothing for this model"
        )
    for key in ("num_hidden_layers", "index_topk"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise UsageError(f"{path}: {key} must be a positive integer, got {config.get(key)!r}")
    return str(path), config


def sizes(args: argparse.Namespace, per_ubatch: int) -> dict:
    """The scheduler settings and byte counts every memory report carries."""
    return {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_ubatches": args.num_ubatches,
        "bytes_per_extra_ubatch": per_ubatch,
        "bytes_total": per_ubatch * (args.num_ubatches - 1),
    }


def print_total(args: argparse.Namespace, report: dict) -> None:
    print(
        f"microbatches: {args.num_ubatches}, so {args.num_ubatches - 1} extra: "
        f"{report['bytes_total']:,} bytes ({report['bytes_total'] / 2**20:.1f} MiB) per GPU, "
        "taken from KV-cache memory"
    )


def memory(args: argparse.Namespace) -> int:
    from vllm_dsa_dbo.ubatch_topk import ubatch_topk_bytes_per_extra_ubatch

    source, config = load_config(args)
    if "index_source_layer_ids" in config:
        return memory_v41(args, source, config)
    leaders = leader_mask(config)
    followed = groups_with_followers(leaders)
    max_decode_rows = min(
        args.max_num_batched_tokens, args.max_num_seqs * (1 + args.num_speculative_tokens)
    )
    extra_ubatches = args.num_ubatches - 1
    per_ubatch = ubatch_topk_bytes_per_extra_ubatch(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_decode_rows=max_decode_rows,
        index_topk=config["index_topk"],
        groups_with_followers=followed,
    )
    report = {
        "model": source,
        "architecture": (config.get("architectures") or ["?"])[0],
        "layers": len(leaders),
        "leaders": [i for i, lead in enumerate(leaders) if lead],
        "followers": sum(not lead for lead in leaders),
        "groups_with_followers": followed,
        "index_topk": config["index_topk"],
        "max_decode_rows": max_decode_rows,
        **sizes(args, per_ubatch),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"model: {source} ({report['architecture']}, {len(leaders)} layers, index_topk {config['index_topk']})")
    print(f"leaders ({len(report['leaders'])}): {' '.join(map(str, report['leaders']))}")
    print(f"followers: {report['followers']}; index groups with followers: G = {followed}")
    print(
        f"max_decode_rows = min({args.max_num_batched_tokens}, "
        f"{args.max_num_seqs} x {1 + args.num_speculative_tokens}) = {max_decode_rows}"
    )
    if extra_ubatches == 0 or followed == 0:
        reason = "no DBO" if extra_ubatches == 0 else "no layer reuses another's top-k"
        print(f"extra memory: 0 bytes ({reason})")
        return 0
    rows = max_decode_rows + 1
    k = config["index_topk"]
    print(f"extra bytes per GPU per extra microbatch: {per_ubatch:,} ({per_ubatch / 2**20:.1f} MiB)")
    print(f"  logical top-k buffer   {args.max_num_batched_tokens} x {k} x 4 = {args.max_num_batched_tokens * k * 4:,}")
    print(f"  physical top-k rows    {followed} x {rows} x {k} x 4 = {followed * rows * k * 4:,}")
    print(f"  valid counts           {followed} x {rows} x 4 = {followed * rows * 4:,}")
    print_total(args, report)
    return 0


def memory_v41(args: argparse.Namespace, source: str, config: dict) -> int:
    """`memory` for a DeepSeek-V4.1 config: its top-k and candidate-block copies."""
    from vllm_dsa_dbo.patches.deepseek_v41_model import bytes_per_extra_ubatch, config_hand_offs

    reusing, candidate_readers = config_hand_offs(config)
    extra_ubatches = args.num_ubatches - 1
    per_ubatch = bytes_per_extra_ubatch(config, args.max_num_batched_tokens)
    report = {
        "model": source,
        "architecture": (config.get("architectures") or ["?"])[0],
        "layers": config["num_hidden_layers"],
        "index_sources": sorted(config["index_source_layer_ids"]),
        "reusing_layers": reusing,
        "candidate_source": config.get("candidate_source_layer_id", -1),
        "candidate_readers": candidate_readers,
        "index_topk": config["index_topk"],
        "candidate_topk_blocks": config.get("candidate_topk_blocks", 0),
        **sizes(args, per_ubatch),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"model: {source} ({report['architecture']}, {report['layers']} layers, CUDA path)")
    print(f"index sources: {' '.join(map(str, report['index_sources']))}")
    print(f"layers reusing an index source's top-k: {' '.join(map(str, reusing)) or 'none'}")
    print(
        f"indexers reading layer {report['candidate_source']}'s candidate blocks: "
        f"{' '.join(map(str, candidate_readers)) or 'none'}"
    )
    if extra_ubatches == 0 or per_ubatch == 0:
        reason = "no DBO" if extra_ubatches == 0 else "no layer reads another's top-k or candidates"
        print(f"extra memory: 0 bytes ({reason})")
        return 0
    tokens = args.max_num_batched_tokens
    mib = per_ubatch / 2**20
    print(f"extra bytes per GPU per extra microbatch: {per_ubatch:,} ({mib:.1f} MiB)")
    if reusing:
        k = config["index_topk"]
        print(f"  top-k buffer           {tokens} x {k} x 4 = {tokens * k * 4:,}")
    if candidate_readers:
        c = config["candidate_topk_blocks"]
        print(f"  candidate-block buffer {tokens} x {c} x 4 = {tokens * c * 4:,}")
    print_total(args, report)
    return 0


# demo -----------------------------------------------------------------------


def demo(args: argparse.Namespace) -> int:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("VLLM_PLUGINS", None)
    summaries = {}
    for phase, disable in (("stock", "1"), ("fixed", "")):
        result = subprocess.run(
            [sys.executable, "-m", "vllm_dsa_dbo.demo", "--phase", phase],
            env={**env, DISABLE_ENV: disable},
            capture_output=True,
            text=True,
        )
        lines = [l for l in result.stdout.splitlines() if l.strip()]
        if result.returncode != 0 or not lines:
            sys.stderr.write(result.stderr[-4000:])
            print(f"error: the {phase} demo failed (exit {result.returncode})", file=sys.stderr)
            return 1
        print("\n".join(lines) + "\n")
        summaries[phase] = lines[-1]
    fixed_clean = " 0 of " in summaries["fixed"]
    print("the fix keeps every follower on its own microbatch's top-k" if fixed_clean
          else "error: reads still crossed microbatches with the fix")
    return 0 if fixed_clean else 1


# ab -------------------------------------------------------------------------


def ab_runs(args: argparse.Namespace) -> list:
    """The runs to compare, reference first: lm_eval folders or live endpoints."""
    from vllm_dsa_dbo.ab import endpoint_runs, load_samples, prompts, read_docs

    if not args.endpoints:
        if len(args.runs) < 2:
            raise UsageError("give two or more lm_eval output folders, or --endpoints")
        for folder in args.runs:
            if not Path(folder).is_dir():
                raise UsageError(f"{folder} is not a folder")
        return [load_samples(Path(folder), args.task, args.metric) for folder in args.runs]
    if args.runs:
        raise UsageError("give lm_eval folders or --endpoints, not both")
    if len(args.endpoints) < 2 or args.questions is None:
        raise UsageError("--endpoints needs two or more URLs and --questions")
    if args.num_fewshot and args.fewshot is None:
        raise UsageError("--num-fewshot needs --fewshot")
    docs = read_docs(args.questions)
    shots = read_docs(args.fewshot) if args.num_fewshot else []
    texts = prompts(docs, shots, args.num_fewshot)
    return endpoint_runs(args.endpoints, docs, texts, args.max_tokens, args.concurrency, args.model)


def ab(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from vllm_dsa_dbo.ab import ABError, compare, table

    try:
        rows = compare(ab_runs(args))
    except ABError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps([{**asdict(r), "mcnemar_z": r.mcnemar_z} for r in rows], indent=1))
    else:
        print(table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dsa-dbo",
        description="DSA shared top-k per DBO microbatch for vLLM 0.33.0: check, size, demonstrate.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("status", help="is the fix active in this environment (exit 1 if not)")
    p.set_defaults(func=status)

    p = sub.add_parser(
        "memory",
        help="leader/follower layout and extra bytes per GPU for a model and scheduler settings",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", help="HF config.json, or a model folder holding one")
    which.add_argument("--preset", choices=sorted(PRESETS), help="built-in model geometry")
    p.add_argument("--max-num-batched-tokens", type=whole_number(1), default=8192)
    p.add_argument("--max-num-seqs", type=whole_number(1), default=1024)
    p.add_argument("--num-speculative-tokens", type=whole_number(0), default=0)
    p.add_argument(
        "--num-ubatches",
        type=whole_number(1),
        default=2,
        help="microbatches per step: 2 with --enable-dbo (default), 1 without",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=memory)

    p = sub.add_parser(
        "ab",
        help="question-by-question A/B of lm_eval --log_samples folders or of live "
        "OpenAI-compatible endpoints (lost/gained, McNemar z, identical responses)",
        description="The first run (folder or endpoint) is the reference, e.g. DBO off.",
    )
    p.add_argument("runs", nargs="*", metavar="RUN", help="lm_eval --log_samples output folder")
    p.add_argument("--task", default="gsm8k", help="task name in samples_<task>_*.jsonl")
    p.add_argument("--metric", default="exact_match", help="per-sample metric; 1 means right")
    live = p.add_argument_group(
        "endpoints",
        "send GSM8K-format questions to each endpoint as lm_eval's gsm8k task does "
        "(greedy /v1/completions, stop at 'Question:') and score them the same way",
    )
    live.add_argument("--endpoints", nargs="+", metavar="URL",
                      help="OpenAI-compatible base URLs, e.g. http://127.0.0.1:8000/v1")
    live.add_argument("--questions", type=Path, metavar="JSONL",
                      help='one {"question": ..., "answer": "... #### N"} per line')
    live.add_argument("--fewshot", type=Path, metavar="JSONL",
                      help="examples in the same format to put before each question")
    live.add_argument("--num-fewshot", type=whole_number(0), default=0,
                      help="examples per question, a fixed random draw for each (default 0)")
    live.add_argument("--max-tokens", type=whole_number(1), default=256,
                      help="completion tokens per question (default 256)")
    live.add_argument("--model", help="model name to ask for (default: the endpoint's /models)")
    live.add_argument("--concurrency", type=whole_number(1), default=64,
                      help="requests in flight per endpoint")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=ab)

    p = sub.add_parser(
        "demo",
        help="run one DBO step through vLLM's real classes on the CPU, stock and fixed",
    )
    p.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
