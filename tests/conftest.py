"""The suite's fixtures. They import torch and vLLM only when used: xdist's controller, which
runs no test, loads this file too."""

import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest


@pytest.fixture(scope="session")
def vllm_env():
    """The plugin applied, a CPU vLLM config and a one-rank gloo world."""
    import vllm_dsa_dbo
    from vllm_dsa_dbo import cpu_dbo

    vllm_dsa_dbo.register()
    with cpu_dbo.cpu_vllm() as config:
        yield config


@pytest.fixture
def fake_gpu(vllm_env):
    from vllm_dsa_dbo import cpu_dbo

    with cpu_dbo.fake_streams():
        yield vllm_env


@contextmanager
def _patches_undone() -> Iterator[None]:
    """What the code under it patches in this process undone when it exits: the symbols each
    `Patch` record lists (`replaces`) on its target, the applied marker, and the checker."""
    from vllm_dsa_dbo import patches
    from vllm_dsa_dbo.diagnostics import isolation, load_check

    saved = [(isolation, "CHECKER")]
    for record in [*patches.fix_patches(), *load_check.PATCHES, *isolation.PATCHES]:
        try:  # imported now, so that no patch of it waits for its import
            target = importlib.import_module(record.target)
        except (ImportError, NotImplementedError):  # as apply_all skips it
            continue
        saved.append((target, patches._APPLIED))
        for name in record.replaces:
            owner, _, attribute = name.rpartition(".")
            saved.append((getattr(target, owner) if owner else target, attribute))
    values = [vars(owner).get(attribute, _UNSET) for owner, attribute in saved]
    try:
        yield
    finally:
        for (owner, attribute), value in reversed(list(zip(saved, values))):
            if value is not _UNSET:
                setattr(owner, attribute, value)
            elif attribute in vars(owner):
                delattr(owner, attribute)


_UNSET = object()


@pytest.fixture
def undo_patches(vllm_env) -> Callable[[], AbstractContextManager[None]]:
    """A context manager: the plugin applied (vllm_env), what the code under it patches on top
    of that (the isolation checker's patches) is undone when it exits."""
    return _patches_undone
