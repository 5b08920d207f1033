"""vLLM's own tests, from its PyPI sdist, run stock and with the plugin loaded.

pip cannot prepare vLLM's sdist metadata without its build dependencies, so
the file itself is fetched through pip's configured index (its simple API),
checked against the sha256 the index gives, and cached.

    python tests/vllm_sdist.py fetch [DIR]      # fetch into DIR (else the cache), print the path
    python tests/vllm_sdist.py trim DIR         # only what a source tree needs, into DIR
    python tests/vllm_sdist.py run PYTEST_ARGS  # run vLLM's tests stock and with the plugin

`run` takes the sdist from $VLLM_DSA_DBO_SDIST, else the cache (fetching it),
runs stock, then with the plugin, prints both pytest summaries and exits 1 if
any test's outcome differs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.version import Version

# The installed vLLM's release: its own tests run against it.
VERSION = Version(importlib.metadata.version("vllm")).public
SDIST = f"vllm-{VERSION}.tar.gz"
SDIST_ENV = "VLLM_DSA_DBO_SDIST"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-dsa-dbo"
# PEP 691's JSON, else the HTML page (PEP 503) with #sha256= fragments.
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


class SdistUnavailable(Exception):
    """The sdist is neither cached nor fetchable: vLLM's tests are skipped."""


def index_url() -> str:
    """pip's configured index (PIP_INDEX_URL, then `pip config`), else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
        )
        url = result.stdout.strip() if result.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def sdist_entry(index: str) -> tuple[str, str]:
    """(url, sha256) of the sdist, as the index's simple API lists it."""
    page_url = f"{index}/vllm/"
    request = urllib.request.Request(page_url, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(request, timeout=60) as response:
        kind, body = response.headers.get_content_type(), response.read().decode()
    if kind.endswith("json"):
        entries = [
            (f["url"], f["hashes"].get("sha256"))
            for f in json.loads(body)["files"]
            if f["filename"] == SDIST
        ]
    else:
        entries = re.findall(rf'href="([^"#]*/{re.escape(SDIST)})#sha256=([0-9a-f]+)"', body)
    if not entries or not entries[0][1]:
        raise SdistUnavailable(f"{index} lists no {SDIST} with a sha256")
    url, digest = entries[0]
    return urllib.request.urljoin(page_url, url), digest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(cache: Path = CACHE) -> Path:
    """The sdist: $VLLM_DSA_DBO_SDIST, else cached in `cache`, else fetched there."""
    given = os.environ.get(SDIST_ENV)
    if given:
        if not Path(given).is_file():
            raise SdistUnavailable(f"{SDIST_ENV}={given} is not a file")
        return Path(given)
    path = cache / SDIST
    if path.is_file():
        return path
    index = index_url()
    try:
        url, expected = sdist_entry(index)
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".part{os.getpid()}")  # test workers may fetch at once
        with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out)
    except (OSError, ValueError, KeyError) as e:
        raise SdistUnavailable(f"cannot fetch {SDIST} from {index}: {e}") from None
    if sha256(partial) != expected:
        partial.unlink()
        raise SdistUnavailable(f"{SDIST} from {index} does not match the index's sha256")
    partial.replace(path)
    return path


# A runnable source tree: these folders of the sdist and its top-level files.
TREE_FOLDERS = ("vllm/", "tests/")


def in_tree(member: tarfile.TarInfo) -> bool:
    """An sdist member a runnable source tree takes (TREE_FOLDERS, the top-level files)."""
    top = f"vllm-{VERSION}/"
    return member.name.startswith(tuple(top + folder for folder in TREE_FOLDERS)) or (
        member.name.count("/") == 1 and member.isfile()
    )


def trim(dest: Path) -> Path:
    """The sdist with only what `in_tree` takes, as `dest/SDIST`: small enough (about half) to
    travel to the GPU machine beside this repository."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / SDIST
    with tarfile.open(fetch()) as src, tarfile.open(out, "w:gz") as dst:
        for member in src:
            if in_tree(member):
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out


def extract_tests(sdist: Path, dest: Path) -> Path:
    """vLLM's `tests/` tree from `sdist`, under `dest`; returns its parent."""
    return _extract_once(sdist, dest, f"vllm-{VERSION}/tests/")


def sources(sdist: Path) -> Path:
    """The whole sdist, extracted once into the cache: the root its trees are copied from
    (copying is a few times cheaper than reading the compressed archive again)."""
    return _extract_once(sdist, CACHE / "sources", f"vllm-{VERSION}/")


def _extract_once(sdist: Path, dest: Path, prefix: str) -> Path:
    """`sdist`'s members under `prefix`, extracted under `dest` unless they are there."""
    root = dest / f"vllm-{VERSION}"
    if not root.is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        # Test workers may extract at once: each into a folder of its own, the first renamed.
        partial = Path(tempfile.mkdtemp(prefix=f"{root.name}.", dir=dest))
        with tarfile.open(sdist) as tar:
            members = (m for m in tar if m.name.startswith(prefix))
            tar.extractall(partial, members=members, filter="data")
        try:
            (partial / root.name).rename(root)
        except OSError:  # another worker's is there
            pass
        shutil.rmtree(partial)
    return root


SPARSE_MLA_TESTS = "tests/v1/attention/test_sparse_mla_backends.py"
SPARSE_MLA_ON_CPU = "tests/v1/attention/test_sparse_mla_backends_on_cpu.py"
# The module skips itself without CUDA or ROCm, though many of its tests need no GPU. Each
# edit must match once.
ON_CPU_EDITS = (
    ("if not (current_platform.is_cuda() or current_platform.is_rocm()):", "if False:"),
    ("DEVICE_TYPE = current_platform.device_type", 'DEVICE_TYPE = "cpu"'),
)
# Its skip marks read the compute capability at import.
ON_CPU_PREAMBLE = "import torch\ntorch.cuda.get_device_capability = lambda *a, **k: (9, 0)\n"
# Its tests of what the plugin and the change touch (the impls' top-k buffer, HiSparse's index
# groups, the sparse MQA lanes), less those that need a GPU (the last is vLLM 0.34.0's).
ON_CPU_SELECTION = (
    "(buffer or hisparse or sparse_mqa) "
    "and not speculative_rows_as_decodes and not residency_by_state_row "
    "and not generic_stream_orders_ipc_event"
)

# Among them, those that build HiSparse index groups with `object.__new__`.
BARE_HISPARSE_TESTS = {
    *(
        f"test_sparse_mqa_hisparse_lanes[{lane}]"
        for lane in ("resident", "staged", "mixed_resident", "mixed_staged", "decode")
    ),
    "test_flashinfer_sm120_hisparse_decode_uses_index_group",
}


def sparse_mla_tests_on_cpu(root: Path) -> list[str]:
    """pytest arguments for a copy of vLLM's sparse MLA backend tests, written under `root`,
    that runs on a CPU the tests of that module that need no GPU."""
    text = (root / SPARSE_MLA_TESTS).read_text()
    for old, new in ON_CPU_EDITS:
        if text.count(old) != 1:
            raise ValueError(f"{SPARSE_MLA_TESTS} does not hold {old!r} once")
        text = text.replace(old, new)
    (root / SPARSE_MLA_ON_CPU).write_text(ON_CPU_PREAMBLE + text)
    return [SPARSE_MLA_ON_CPU, "-k", ON_CPU_SELECTION]


# Stock: no plugin loads (VLLM_PLUGINS matches none). With the plugin: registered
# before collection, and the run stops unless it patched vLLM.
RUNNERS = {
    "stock": "",
    "plugin": (
        "import vllm_dsa_dbo; vllm_dsa_dbo.register(); "
        "from vllm.v1.attention.backends.mla import index_group; "
        "from vllm_dsa_dbo.patches import applied; "
        "'index_group' in applied(index_group) or sys.exit('not patched')\n"
    ),
}
# Without a GPU every test takes vLLM's marker for those that need no GPU cleanup: its per-test
# cleanup collects the whole heap (gc.unfreeze, gc.collect), about 0.6 s a test on a CPU.
PYTEST = """
class NoGpu:
    def pytest_collection_modifyitems(self, items):
        for item in items:
            item.add_marker(pytest.mark.skip_global_cleanup)
import torch
sys.exit(pytest.main(sys.argv[1:], plugins=[] if torch.accelerator.is_available() else [NoGpu()]))
"""


def run(
    root: Path, args: list[str], mode: str, env_extra: dict[str, str] | None = None
) -> tuple[str, dict[str, str]]:
    """One pytest run of vLLM's tests under `root`: its summary line and each test's outcome.

    Each run is a fresh interpreter (fresh.py).
    """
    import fresh  # imports torch and vLLM (not needed to fetch), setting variables of theirs

    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS" and "DSA_DBO" not in k}
    env.update(env_extra or {})
    if mode == "stock":
        env["VLLM_PLUGINS"] = ""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        code = f"import sys, pytest\n{RUNNERS[mode]}{PYTEST}"
        command = ["-c", code, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        command += args
        result = fresh.python(command, env, cwd=root, timeout=None)
        lines = result.stdout.strip().splitlines() or [result.stderr.strip()[-2000:]]
        if not report.is_file():
            return f"{mode}: no report ({lines[-1]})", {}
        outcomes = {}
        for case in ET.parse(report).iter("testcase"):
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[f"{case.get('classname')}::{case.get('name')}"] = (kinds or ["passed"])[0]
    return f"{mode}: {lines[-1]}", outcomes


def compare(root: Path, args: list[str], workers: int) -> dict[str, tuple[str, dict[str, str]]]:
    """The stock and the plugin run, `workers` at a time (a GPU takes one)."""
    with ThreadPoolExecutor(workers) as pool:
        runs = {mode: pool.submit(run, root, args, mode) for mode in RUNNERS}
        return {mode: future.result() for mode, future in runs.items()}


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"] and len(argv) <= 2:
        print(fetch(Path(argv[1]) if len(argv) > 1 else CACHE))
        return 0
    if argv[:1] == ["trim"] and len(argv) == 2:
        print(trim(Path(argv[1])))
        return 0
    if argv[:1] != ["run"] or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = extract_tests(fetch(), CACHE / "src")
    runs = compare(root, argv[1:], workers=1)
    for summary, _ in runs.values():
        print(summary)
    same = runs["stock"][1] == runs["plugin"][1] and runs["stock"][1]
    print("same outcomes, test by test" if same else "OUTCOMES DIFFER (or nothing ran)")
    return 0 if same else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SdistUnavailable as e:
        sys.exit(f"error: {e}")
