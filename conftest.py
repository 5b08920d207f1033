"""The environment of every CPU test, the suite's and the harness's (tests/, validation/)."""

import os

from vllm_dsa_dbo.demo import use_cpu

# Before anything imports vLLM. use_cpu's variables are read at import, so a fresh interpreter
# forks from the server (tests/fresh.py) only if the whole suite has them. Offline: nothing
# here reaches the Hub. Humming (which vLLM's DeepSeek-V4.1 layers import) starts two
# background CUDA builds, each a Python process importing torch, in every process that
# imports it; no CPU run uses what they build.
use_cpu()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
# Each xdist worker has a core: one torch thread in it and in what it starts, not one per core.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
