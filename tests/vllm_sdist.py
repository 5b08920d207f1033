"""vLLM's own tests, from its PyPI sdist: fetched through pip's configured index.

pip cannot prepare vLLM's sdist metadata without its build dependencies, so
the file itself is fetched through the index's simple API, checked against the
sha256 the index gives, and cached. `python tests/vllm_sdist.py [DIR]` fetches
it (into DIR, else the cache) and prints its path.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SDIST_ENV = "VLLM_DSA_DBO_SDIST"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-dsa-dbo"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


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
    request = urllib.request.Request(f"{index}/vllm/", headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=60) as response:
        page = json.load(response)
    for entry in page["files"]:
        if entry["filename"] == SDIST:
            return urllib.request.urljoin(f"{index}/vllm/", entry["url"]), entry["hashes"]["sha256"]
    raise SdistUnavailable(f"{index} lists no {SDIST}")


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
        partial = path.with_suffix(".part")
        urllib.request.urlretrieve(url, partial)
    except (OSError, ValueError, KeyError) as e:
        raise SdistUnavailable(f"cannot fetch {SDIST} from {index}: {e}") from None
    if sha256(partial) != expected:
        partial.unlink()
        raise SdistUnavailable(f"{SDIST} from {index} does not match the index's sha256")
    partial.rename(path)
    return path


def extract_tests(sdist: Path, dest: Path) -> Path:
    """vLLM's `tests/` tree from `sdist`, under `dest`; returns its parent."""
    root = dest / f"vllm-{VERSION}"
    if not (root / "tests").is_dir():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{root.name}/tests/")]
            tar.extractall(dest, members=members, filter="data")
    return root


if __name__ == "__main__":
    try:
        print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else CACHE))
    except SdistUnavailable as e:
        sys.exit(f"error: {e}")
