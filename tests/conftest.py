# Sets Triton's environment before anything imports vLLM (see its docstring).
import vllm_dsa_dbo.cpu_dbo as cpu_dbo  # noqa: I001

import pytest


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
