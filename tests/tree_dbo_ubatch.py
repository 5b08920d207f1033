"""The upstream change's test, from a vLLM tree's test_sparse_mla_backends.py, on a CPU.

That module skips itself without CUDA or ROCm, so this one takes the test's
function from it (by name, through `ast`) and runs it here, with the CPU
stand-ins for streams and events. Run by pytest in the tree's root.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backends.mla import index_group as index_group_module
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

from vllm_dsa_dbo import cpu_dbo
from vllm_dsa_dbo.upstream import NEW_TEST, TEST_FILE

# The names the test reads from its module.
NAMESPACE = {
    "DEVICE_TYPE": "cpu",
    "SimpleNamespace": SimpleNamespace,
    "SharedTopkIndicesBuffer": SharedTopkIndicesBuffer,
    "SparseMLAIndexGroupBuilder": SparseMLAIndexGroupBuilder,
    "index_group_module": index_group_module,
    "torch": torch,
}

_function = next(
    node
    for node in ast.parse(Path(TEST_FILE).read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name == NEW_TEST
)
exec(compile(ast.Module([_function], []), TEST_FILE, "exec"), NAMESPACE)
globals()[NEW_TEST] = NAMESPACE[NEW_TEST]


@pytest.fixture(autouse=True)
def _fake_streams():
    with cpu_dbo.fake_streams():
        yield
