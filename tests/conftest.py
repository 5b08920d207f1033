import os

import pytest

from vllm_dsa_dbo.demo import use_cpu

# Before anything imports vLLM. use_cpu's variables are read at import, so a fresh interpreter
# forks from the server (tests/fresh.py) only if the whole suite has them. Offline: nothing
# here reaches the Hub. Humming (which vLLM's DeepSeek-V4.1 layers import) starts two
# background CUDA builds, each a Python process importing torch, in every process that
# imports it; no CPU run uses what they build.
use_cpu()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

from vllm_dsa_dbo import cpu_dbo  # noqa: E402


@pytest.fixture(scope="session")
def vllm_env():
    """The plugin applied, a CPU vLLM config and a one-rank gloo world."""
    import vllm_dsa_dbo

    vllm_dsa_dbo.register()
    with cpu_dbo.cpu_vllm() as config:
        yield config


@pytest.fixture
def fake_gpu(vllm_env):
    with cpu_dbo.fake_streams():
        yield vllm_env
