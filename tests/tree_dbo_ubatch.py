"""The upstream change's tests, from a vLLM tree's test files, on a CPU.

vLLM's test_sparse_mla_backends.py skips itself without CUDA or ROCm, so this module takes
the change's test functions from it (by name, through `ast`) and runs them here; a test file
the change adds runs whole, where the tree has it (one that carries the change's core alone
lacks the later parts' files). Both run with the CPU stand-ins for streams and events and on the CPU
device. Run by pytest in the tree's root, for the installed vLLM's release.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import MethodType, SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.models.deepseek_v32 import attention as deepseek_v32_attention
from vllm.v1.attention.backends.mla import index_group as index_group_module
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

import vllm_sdist
from vllm_dsa_dbo import cpu_dbo
from vllm_dsa_dbo.upstream import NEW_FILE, RELEASES

CHANGE = RELEASES[vllm_sdist.VERSION]
# The names the change's test reads from vLLM's sparse MLA test module.
NAMESPACE = {
    "DEVICE_TYPE": "cpu",
    "MagicMock": MagicMock,
    "MethodType": MethodType,
    "SimpleNamespace": SimpleNamespace,
    "deepseek_v32_attention": deepseek_v32_attention,
    "pytest": pytest,
    "SharedTopkIndicesBuffer": SharedTopkIndicesBuffer,
    "SparseMLAIndexGroupBuilder": SparseMLAIndexGroupBuilder,
    "index_group_module": index_group_module,
    "torch": torch,
}


def namespace(path: str, names: list[str]) -> dict[str, object]:
    """The module namespace `names` run in: a file the change adds, whole; else `names`
    alone, with NAMESPACE."""
    tree = ast.parse(Path(path).read_text())
    found: dict[str, object] = {"__name__": Path(path).stem}
    if NEW_FILE in CHANGE.files[path]:
        exec(compile(tree, path, "exec"), found)
        found["DEVICE_TYPE"] = "cpu"
        return found
    found.update(NAMESPACE)
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    exec(compile(ast.Module(wanted, []), path, "exec"), found)
    return found


for _path, _names in CHANGE.tests.items():
    if not Path(_path).is_file():
        continue
    _module = namespace(_path, _names)
    globals().update({name: _module[name] for name in _names})


@pytest.fixture(autouse=True)
def _fake_streams():
    with cpu_dbo.fake_streams():
        yield
