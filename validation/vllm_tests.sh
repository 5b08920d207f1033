#!/usr/bin/env bash
# vLLM 0.33.0's own sparse MLA backend tests on a GPU, stock and with vllm-dsa-dbo loaded:
# prints both pytest summaries and whether every test's outcome is the same.
# Here, before the tree travels (.vllm-sdist/ is ignored; vLLM's conftest needs tblib):
#   python tests/vllm_sdist.py fetch .vllm-sdist && pip download --no-deps -d .vllm-sdist tblib
# On the GPU machine:
#   validation/vllm_tests.sh [PYTEST_ARGS]
# VLLM_DSA_DBO_SDIST names the sdist (default .vllm-sdist/vllm-0.33.0.tar.gz in this checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f /tmp/gpu/env.sh ] && . /tmp/gpu/env.sh
export VLLM_DSA_DBO_SDIST="${VLLM_DSA_DBO_SDIST:-$PWD/.vllm-sdist/vllm-0.33.0.tar.gz}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import tblib" 2>/dev/null ||
    python -m pip install -q --no-index --find-links .vllm-sdist tblib
python tests/vllm_sdist.py run tests/v1/attention/test_sparse_mla_backends.py \
    -k 'not correctness' "$@"
