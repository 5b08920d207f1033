"""`vllm-dsa-dbo`: is the fix active, what does it cost, what does it fix."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_dsa_dbo import __version__
from vllm_dsa_dbo.diagnostics.layout import (
    GROUPS,
    PLATFORMS,
    REFUSED,
    UNSHARED,
    VLLM_VERSION,
    Layout,
    check_config,
    from_mistral,
    layout,
    ubatch_topk_bytes_per_extra_ubatch,
)
from vllm_dsa_dbo.settings import (
    CHECK_ENV,
    DISABLE_ENV,
    REFUSE,
    RELEASES,
    STOCK,
    SUPPORTED_VLLM,
    EnvValueError,
    check_mode,
    disable_mode,
    is_supported_vllm,
    retired_layout_notice,
)

if TYPE_CHECKING:
    from vllm_dsa_dbo.patches._shared import Patch

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "dsa_dbo"
HF_CONFIG = "config.json"
MISTRAL_CONFIG = "params.json"

GLM53 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "num_hidden_layers": 78,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
}
PRESETS = {"glm-5.3": GLM53}
DISABLE_MEANING = {
    None: "fix on",
    REFUSE: "fix off, DBO with shared top-k refused",
    STOCK: "stock vLLM: nothing refused, DBO outputs corrupted",
}
# `python -m vllm_dsa_dbo.demo` exits with this when a read crossed microbatches, and with
# DEMO_NO_VLLM, its last stderr line saying why, when vLLM does not import.
DEMO_CROSSED = 3
DEMO_NO_VLLM = 2
INSTALL_VLLM = (
    "install vLLM 0.33.0 or 0.34.0 beside the plugin, as README.md's Install says "
    "(pip install vllm==0.33.0, or vLLM 0.34.0's container image)"
)


class UsageError(Exception):
    """Bad input: printed as `error: ...`, exit status 2."""


def vllm_unusable() -> str | None:
    """Why the plugin cannot run this environment's vLLM, with what to install; None when
    `import vllm` works."""
    try:
        dist = distribution("vllm")
    except PackageNotFoundError:
        dist = None
    if dist is None and find_spec("vllm") is None:
        return f"vLLM is not installed: {INSTALL_VLLM}"
    try:
        import vllm  # noqa: F401
    except Exception as e:
        name = "vLLM" if dist is None else f"vLLM {dist.version}"
        return f"{name} does not import ({type(e).__name__}: {e}): {INSTALL_VLLM}"
    return None


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


def probability(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}")
    return value


# status ---------------------------------------------------------------------


def status(args: argparse.Namespace) -> int:
    problems = []
    unusable = vllm_unusable()
    if unusable is not None:
        problems.append(unusable)
        state = "not installed" if find_spec("vllm") is None else "does NOT import"
        print(f"vLLM: {state} (supported: {SUPPORTED_VLLM})")
    else:
        import vllm

        ok = is_supported_vllm(vllm.__version__)
        print(
            f"vLLM: {vllm.__version__} ({'supported' if ok else 'NOT supported'}; "
            f"this plugin supports {SUPPORTED_VLLM})"
        )
        if not ok:
            problems.append(
                f"vLLM {vllm.__version__} is not a supported release ({SUPPORTED_VLLM}): the "
                "plugin patches nothing"
            )
            print(f"guard: DBO with a shared-top-k DSA model is refused at {guard_seam()}")
    # The tests check every patch against each release; any other vLLM is checked here.
    inspect_vllm = unusable is None and (args.check or not unmodified_release())

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
        spaced = ENTRY_POINT_NAME in [name.strip() for name in allowed.split(",")]
        problems.append(
            f"VLLM_PLUGINS filters out {ENTRY_POINT_NAME}"
            + (" (vLLM matches names exactly: drop the spaces)" if spaced else "")
        )

    errors: list[str] = []
    checking, check = check_line(errors)
    try:
        disabled = disable_mode()
    except EnvValueError as e:
        errors.append(f"{e}; vLLM logs this and applies the fix")
        print(f"{DISABLE_ENV}: {env_shown(DISABLE_ENV)} NOT understood")
    else:
        meaning = DISABLE_MEANING[disabled]
        if disabled:
            meaning += (
                "; the plugin patches nothing"
                if checking is None
                else "; the plugin installs only the isolation checker's patches"
            )
            problems.append(f"{DISABLE_ENV} is set")
        print(f"{DISABLE_ENV}: {env_shown(DISABLE_ENV)} ({meaning})")
    print(check)
    retired = retired_layout_notice()
    if retired:
        print(retired)
    if inspect_vllm:
        # Importing vLLM's DeepSeek-V4.1 code starts two kernel builds, each a Python process
        # importing torch, which take the CPU and which this process waits for at exit.
        os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
        print(
            "status: importing vLLM's attention and model code to check the patches against it...",
            file=sys.stderr,
            flush=True,
        )
        print_patches(problems)
    else:
        from vllm_dsa_dbo.diagnostics import isolation, load_check
        from vllm_dsa_dbo.patches import NAMES

        print(
            f"patches: {len(NAMES) + len(load_check.PATCHES)} ({len(isolation.PATCHES)} more "
            f"with {CHECK_ENV} "
            "set), as tested on this vLLM release; `vllm-dsa-dbo status --check` lists them "
            "and checks each against this install's vLLM code"
        )

    if problems:
        print("fix NOT active: " + "; ".join(problems))
    if errors:
        raise UsageError("; ".join(errors))
    if problems:
        return 1
    print("fix active: vLLM will apply it in every process")
    return 0


def unmodified_release() -> bool:
    """The vLLM that imports here is a supported release as published: installed from an
    index, every Python file as its RECORD lists it (not an edited, locally built or
    shadowing tree)."""
    try:
        dist = distribution("vllm")
    except PackageNotFoundError:
        return False
    spec = find_spec("vllm")
    if (
        dist.version not in RELEASES
        or dist.read_text("direct_url.json") is not None
        or spec is None
        or spec.origin is None
        or Path(spec.origin).parent != Path(dist.locate_file("vllm"))
    ):
        return False
    for file in dist.files or ():
        if file.hash is not None and file.name.endswith(".py"):
            digest = base64.urlsafe_b64encode(hashlib.sha256(file.read_binary()).digest())
            if digest.rstrip(b"=").decode() != file.hash.value:
                return False
    return True


def print_patches(problems: list[str]) -> None:
    """Each patch, and why it would be left unapplied here; `problems` gets those that are."""
    from vllm_dsa_dbo.diagnostics import isolation, load_check
    from vllm_dsa_dbo.patches import CARRIED, diagnose, fix_patches, overridden, release

    every = [*fix_patches(), *load_check.PATCHES]
    if not problems:
        load_plugins(problems)
    wiring = {} if problems else diagnose(every)
    here = release()
    print("patches:")
    for patch in every:
        print_patch(patch)
        if patch.name in CARRIED:
            print(f"    CARRIED by this vLLM, so not applied: {CARRIED[patch.name]}")
        elif wiring.get(patch.name) is not None:
            print(f"    LEFT UNAPPLIED here: {wiring[patch.name]}")
            problems.append(f"patch {patch.name} is left unapplied")
        elif patch.name in wiring:
            print(f"    fits this vLLM: its seam is vLLM {here}'s (sha256 {patch.fits[here]})")
        elif here is not None and here not in patch.fits:
            print(f"    not in vLLM {here}: its seam first came in {min(patch.fits)}")
    print(f"isolation checker patches (only with {CHECK_ENV} set):")
    for patch in isolation.PATCHES:
        print_patch(patch)
    if any(wiring.get(patch.name) is not None for patch in load_check.PATCHES):
        print(f"guard: DBO with a shared-top-k DSA model is refused at {guard_seam()}")

    if CARRIED:
        own = [name for name, reason in wiring.items() if reason is None and name not in CARRIED]
        print(f"this vLLM carries {', '.join(CARRIED)}; the plugin applies {', '.join(own)}")
    for line in overridden():
        print(f"{line}, which the plugin set")
        problems.append(line)


def load_plugins(problems: list[str]) -> None:
    """vLLM's general plugins, loaded as every vLLM process loads them: what another plugin's
    register() sets over the fix's patches is then there to name."""
    from vllm.plugins import load_general_plugins

    try:
        load_general_plugins()
    except Exception as e:  # as a vLLM process would stop: reported, not raised
        print(f"vLLM's general plugins: loading them failed: {type(e).__name__}: {e}")
        problems.append("a vLLM general plugin fails to load")


def print_patch(patch: Patch) -> None:
    print(f"  {patch.target}: {', '.join(patch.replaces)}")
    print(f"    how: {patch.how}\n    remove when: {patch.remove_when}")
    if patch.differs:
        print(f"    between releases: {patch.differs}")


def guard_seam() -> str:
    """Where the guard would refuse, found without installing it."""
    from vllm_dsa_dbo import guard

    return " and ".join(guard.seams()) or "NO seam: such runs are NOT refused"


def env_shown(name: str) -> str:
    return repr(os.environ[name]) if name in os.environ else "not set"


def check_line(errors: list[str]) -> tuple[str | None, str]:
    """The checker mode and the status line for VLLM_DSA_DBO_CHECK; a value it does not
    know goes to `errors` (and means off, as in vLLM)."""
    try:
        mode = check_mode()
    except EnvValueError as e:
        errors.append(f"{e}; vLLM logs this and runs with the checker off")
        return None, f"{CHECK_ENV}: {env_shown(CHECK_ENV)} NOT understood"
    state = "off" if mode is None else f"on in every vLLM process, mode {mode}"
    return mode, f"{CHECK_ENV}: {env_shown(CHECK_ENV)} (isolation checker {state})"


# memory ---------------------------------------------------------------------


def load_config(args: argparse.Namespace) -> tuple[str, Layout]:
    """The model's layout on the chosen platform; a config.json is checked before vLLM is
    imported."""
    if args.preset:
        source, config, mistral = f"preset {args.preset}", PRESETS[args.preset], False
    else:
        path = config_file(Path(args.config))
        source, config, mistral = str(path), read_json(path), path.name == MISTRAL_CONFIG
        if not isinstance(config, dict):
            raise UsageError(f"{path} is not a JSON object")
    try:
        if mistral:
            require_vllm()
            config = from_mistral(config)
        code_path, text = check_config(config, args.platform)
        require_vllm()
        return source, layout(code_path, text)
    except ValueError as e:  # ConfigError, or vLLM's own config class refusing it
        raise UsageError(f"{source}: {e}") from None


def config_file(path: Path) -> Path:
    """`path`, or the config file in that model folder that vLLM's config_format "auto" reads."""
    if not path.is_dir():
        return path
    present = [path / name for name in (HF_CONFIG, MISTRAL_CONFIG) if (path / name).is_file()]
    if not present:
        raise UsageError(
            f"{path} holds neither {HF_CONFIG} (HF format) nor {MISTRAL_CONFIG} (Mistral format)"
        )
    if len(present) == 1:
        return present[0]
    require_vllm()
    from vllm.transformers_utils.repo_utils import is_mistral_model_repo

    return path / (MISTRAL_CONFIG if is_mistral_model_repo(str(path)) else HF_CONFIG)


def require_vllm() -> None:
    if unusable := vllm_unusable():
        raise UsageError(unusable)


def read_json(path: Path) -> object:
    from vllm_dsa_dbo.ab import ABError, read_text

    try:
        return json.loads(read_text(path))
    except ABError as e:
        raise UsageError(str(e)) from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from None


def memory(args: argparse.Namespace) -> int:
    source, model = load_config(args)
    followed = model.groups_with_followers
    max_decode_rows = min(
        args.max_num_batched_tokens, args.max_num_seqs * (1 + args.num_speculative_tokens)
    )
    extra_ubatches = args.num_ubatches - 1
    k, tokens = model.index_topk, args.max_num_batched_tokens
    per_ubatch = ubatch_topk_bytes_per_extra_ubatch(
        max_decode_rows=max_decode_rows,
        groups_with_followers=followed if model.path.kept == GROUPS else 0,
    ) + sum(tokens * columns * 4 for _, columns in model.buffers)
    refused = model.refused_under_dbo and extra_ubatches > 0
    if extra_ubatches == 0:
        verdict = "no DBO: nothing allocated"
    elif refused:
        verdict = (
            f"{REFUSED}: with --enable-dbo every worker stops at model load with a message, "
            "since the plugin does not keep this path's shared top-k per microbatch"
        )
    elif model.path.kept == UNSHARED:
        verdict = UNSHARED
    elif not model.followers:
        verdict = "no layer reuses another's top-k: nothing allocated"
    else:
        verdict = f"allocated at model load: {model.path.kept}"
    report = {
        "model": source,
        "architecture": model.architecture,
        "platform": args.platform,
        "vllm": VLLM_VERSION,
        "code_path": model.path.module,
        "layers": model.num_layers,
        "leaders": model.leaders,
        "followers": len(model.followers),
        "groups_with_followers": followed,
        "index_topk": k,
        "copied_buffers": dict(model.buffers),
        "max_num_batched_tokens": tokens,
        "max_decode_rows": max_decode_rows,
        "num_ubatches": args.num_ubatches,
        "verdict": verdict,
        "notes": model.notes,
        "bytes_per_extra_ubatch": None if refused else per_ubatch,
        "bytes_total": None if refused else per_ubatch * extra_ubatches,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"model: {source} ({model.architecture}, {model.num_layers} layers, index_topk {k})")
    print(f"vLLM {VLLM_VERSION} code path: {model.path.module} ({args.platform})")
    if model.leaders is not None:
        print(f"leaders ({len(model.leaders)}): {' '.join(map(str, model.leaders)) or 'none'}")
    reads = "top-k or candidate blocks" if model.path.rule == "deepseek_v41" else "top-k"
    print(
        f"followers ({len(model.followers)}, reading another layer's {reads}): "
        f"{' '.join(map(str, model.followers)) or 'none'}"
    )
    for note in model.notes:
        print(f"note: {note}")
    if per_ubatch == 0 or refused or extra_ubatches == 0:
        print(f"extra memory: {'none' if refused else '0 bytes'}; {verdict}")
        return 0
    print(
        f"extra bytes per GPU per extra microbatch: {per_ubatch:,} ({per_ubatch / 2**20:.1f} MiB)"
    )
    for name, columns in model.buffers:
        print(f"  {name:<22} {tokens} x {columns} x 4 = {tokens * columns * 4:,}")
    if model.path.kept == GROUPS:
        rows = max_decode_rows + 1
        at_offset = "microbatch 0's, from the token offset: 0"
        print(
            f"  index groups with followers: G = {followed}; max_decode_rows = "
            f"min({tokens}, {args.max_num_seqs} x {1 + args.num_speculative_tokens}) = "
            f"{max_decode_rows}"
        )
        print(f"  logical top-k buffer   {at_offset}")
        print(f"  physical top-k rows    {at_offset}")
        print(f"  valid counts           {followed} x {rows} x 4 = {followed * rows * 4:,}")
    print(
        f"microbatches: {args.num_ubatches}, so {extra_ubatches} extra: "
        f"{report['bytes_total']:,} bytes ({report['bytes_total'] / 2**20:.1f} MiB) per GPU, "
        "taken from KV-cache memory"
    )
    return 0


# demo -----------------------------------------------------------------------


def demo(args: argparse.Namespace) -> int:
    try:
        disable_mode()
        check = check_mode()
    except EnvValueError as e:
        raise UsageError(str(e)) from None
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("VLLM_PLUGINS", None)
    crossed = {}
    for phase, disable in (("stock", STOCK), ("fixed", "")):
        result = subprocess.run(
            [sys.executable, "-m", "vllm_dsa_dbo.demo", "--phase", phase],
            env={**env, DISABLE_ENV: disable},
            capture_output=True,
            text=True,
        )
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        if result.returncode == DEMO_NO_VLLM:
            raise UsageError(result.stderr.strip().splitlines()[-1])
        if result.returncode not in (0, DEMO_CROSSED) or not lines:
            sys.stderr.write(result.stderr[-4000:])
            print(f"error: the {phase} demo failed (exit {result.returncode})", file=sys.stderr)
            return 1
        print("\n".join(lines) + "\n")
        crossed[phase] = result.returncode == DEMO_CROSSED
    if crossed["fixed"]:
        print("error: reads still crossed microbatches with the fix", file=sys.stderr)
        return 1
    checked = f", and the isolation checker ({check}) saw no bad read" if check else ""
    print(f"the fix keeps every follower on its own microbatch's top-k{checked}")
    return 0


# ab -------------------------------------------------------------------------


AB_HOWTO = (
    "Compare lm_eval runs question by question; the first RUN is the reference (e.g. DBO off).\n"
    "Make one run per server, lm_eval's local-completions model with --log_samples:\n\n"
    "  lm_eval --model local-completions --tasks gsm8k --num_fewshot 5 --log_samples \\\n"
    "    --model_args model=MODEL,base_url=http://HOST:8000/v1/completions,"
    "num_concurrent=64,tokenized_requests=False \\\n"
    "    --output_path results/dbo-off\n\n"
    "and the same against the DBO-on server into results/dbo-on, then\n\n"
    "  vllm-dsa-dbo ab results/dbo-off results/dbo-on\n"
)


def ab(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from vllm_dsa_dbo.ab import ABError, compare, load_runs, table

    if len(args.runs) < 2:
        raise UsageError("give two or more lm_eval runs: --output_path folders or samples files")
    try:
        rows = compare(load_runs([Path(run) for run in args.runs], args.task, args.metric))
    except ABError as e:
        raise UsageError(str(e)) from None
    if args.json:
        out = [{**asdict(r), "mcnemar_z": r.mcnemar_z, "mcnemar_p": r.mcnemar_p} for r in rows]
        print(json.dumps(out, indent=1))
    else:
        print(table(rows))
    worse = [
        f"{r.run} ({r.filter}): lost {r.lost}, gained {r.gained}, exact p {p:.3g}"
        for r in rows
        if args.alpha is not None
        and (p := r.mcnemar_p) is not None  # None: the reference itself
        and r.lost > r.gained
        and p < args.alpha
    ]
    if worse:
        print(f"worse than {rows[0].run} at p < {args.alpha}: " + "; ".join(worse), file=sys.stderr)
        return 1
    return 0


# upstream-patch -------------------------------------------------------------


def upstream_patch(args: argparse.Namespace) -> int:
    from vllm_dsa_dbo import upstream

    src = Path(args.src)
    if not src.is_dir():
        raise UsageError(f"{src} is not a directory: give the root of a vLLM source tree")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists():
        raise UsageError(f"--out {out} exists: name a new folder for the patched copy")
    try:
        changes = upstream.plan(src, first_only=args.core_only)
    except upstream.PatchRefused as e:
        raise UsageError(f"cannot patch {src}: {e}; nothing written") from None
    sys.stdout.writelines(upstream.unified_diff(changes))
    if args.dry_run:
        return 0
    try:
        if out is not None:
            shutil.copytree(src, out, symlinks=True)
        upstream.write(out or src, changes)
    except OSError as e:
        raise UsageError(f"cannot write the patched tree to {out or src}: {e}") from None
    print(f"patched {len(changes)} files in {out or src}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dsa-dbo",
        description=(
            f"DSA shared top-k per DBO microbatch for vLLM {SUPPORTED_VLLM}: check, size, "
            "demonstrate."
        ),
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__} (for vLLM {SUPPORTED_VLLM})",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("status", help="is the fix active in this environment (exit 1 if not)")
    p.add_argument(
        "--check",
        action="store_true",
        help="list the patches and check each against this vLLM's code (imports it: slower); "
        f"always done for a vLLM other than the {SUPPORTED_VLLM} releases",
    )
    p.set_defaults(func=status)

    p = sub.add_parser(
        "memory",
        help="leader/follower layout and extra bytes per GPU for a model and scheduler settings",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--config",
        help="HF config.json or Mistral params.json, or a model folder holding either",
    )
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
    p.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="cuda",
        help="the GPU platform vLLM runs on: its code path (and so what is kept) differ",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=memory)

    p = sub.add_parser(
        "ab",
        help="question-by-question A/B of lm_eval --log_samples runs (lost/gained, McNemar, "
        "identical responses)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=AB_HOWTO,
    )
    p.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="lm_eval --output_path folder, or the samples_<task>_<date>.jsonl in it",
    )
    p.add_argument("--task", default="gsm8k", help="task name in samples_<task>_*.jsonl")
    p.add_argument("--metric", default="exact_match", help="per-sample metric; 1 means right")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument(
        "--alpha",
        type=probability,
        help="exit 1 if a run lost more questions than it gained against the reference, "
        "with McNemar's exact p below ALPHA (e.g. 0.05); without it, exit 0 whatever the figures",
    )
    p.set_defaults(func=ab)

    p = sub.add_parser(
        "upstream-patch",
        help="edit a vLLM 0.33.0 or 0.34.0 source tree so that it carries the fix natively; "
        "prints the change as a git diff",
    )
    p.add_argument("src", metavar="SRC", help="root of a vLLM source tree (git checkout or sdist)")
    p.add_argument("--out", metavar="DIR", help="write the patched tree to DIR, a new copy of SRC")
    p.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    p.add_argument(
        "--core-only",
        action="store_true",
        help="the core change alone (GLM-5, DeepSeek-V3.2: the upstream PR's scope), not the "
        "Mistral Large 4 change (vLLM 0.34.0) that applies on top of it; a later run without "
        "it adds that change alone",
    )
    p.set_defaults(func=upstream_patch)

    sub.add_parser(
        "demo", help="run one DBO step through vLLM's real classes on the CPU, stock and fixed"
    ).set_defaults(func=demo)
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
