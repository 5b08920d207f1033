import pytest

from vllm_dsa_dbo.testing import use_cpu

# Before anything imports vLLM.
use_cpu()

from vllm_dsa_dbo.testing import cpu_dbo  # noqa: E402


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
