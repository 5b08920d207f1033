#!/usr/bin/env bash
# vLLM 0.33.0's sparse MLA backend tests on a GPU in the released source tree, unpatched and
# through `vllm-dsa-dbo upstream-patch`: both summaries, whether every test's outcome but the
# change's own test (in the patched file only) is the same, and that test's outcome
# (tests/upstream_tree.py).
# Here, before the tree travels (.vllm-sdist/ is ignored; vLLM's conftest needs tblib; the whole
# sdist, 47 MB, does not fit beside the repository in one call, its trees' part, 17 MB, does):
#   python tests/vllm_sdist.py trim .vllm-sdist && pip download --no-deps -d .vllm-sdist tblib
# On the GPU machine (carry .vllm-sdist):
#   validation/upstream_tests.sh [PYTEST_ARGS]
# PYTEST_ARGS (e.g. -k "not correctness") narrow vLLM's test_sparse_mla_backends.py. VLLM_DSA_DBO_SDIST names the sdist (default .vllm-sdist/vllm-0.33.0.tar.gz here);
# the trees go to VLLM_DSA_DBO_TREES (default /tmp/vllm-dsa-dbo-trees).
# Without the Hub, the cases that read DeepSeek-V2-Lite-Chat's config take a stand-in:
#   HF_HUB_OFFLINE=1 HF_HUB_CACHE=$PWD/validation/hf-stand-ins validation/upstream_tests.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f /tmp/gpu/env.sh ] && . /tmp/gpu/env.sh
export VLLM_DSA_DBO_SDIST="${VLLM_DSA_DBO_SDIST:-$PWD/.vllm-sdist/vllm-0.33.0.tar.gz}"
export VLLM_DSA_DBO_TREES="${VLLM_DSA_DBO_TREES:-/tmp/vllm-dsa-dbo-trees}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python -c "import tblib" 2>/dev/null ||
    python -m pip install -q --no-index --find-links .vllm-sdist tblib
python tests/upstream_tree.py tests/v1/attention/test_sparse_mla_backends.py "$@"
