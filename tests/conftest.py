import os

# The logical -> physical top-k conversion is a Triton kernel; run it on the CPU.
# Triton reads this when vLLM defines its kernels, so set it before any import.
os.environ.setdefault("TRITON_INTERPRET", "1")
# vLLM swaps Triton for a placeholder on a host with no GPU driver, unless the
# visible-device list is empty (as under Ray); empty it so the kernel is real.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import socket  # noqa: E402

import pytest  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_env():
    """The plugin applied, a CPU vLLM config and a one-rank gloo world."""
    import vllm_dsa_dbo
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    vllm_dsa_dbo.register()
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        yield config


@pytest.fixture
def fake_gpu(vllm_env, monkeypatch):
    import fake_gpu

    fake_gpu.install(monkeypatch)
    return vllm_env
