"""The patch record and the helpers several patches use; no patch imports another."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Patch:
    """What a patch sets on one vLLM module, why, and when it can go."""

    name: str
    target: str
    # The target module's symbols `apply` sets, as `name` or `Class.attribute`.
    replaces: tuple[str, ...]
    why: str
    how: str
    upstream: str
    remove_when: str
    apply: Callable[[ModuleType], None]
    # Per supported release, the fingerprint (`carried.seam_digest`) of the target's symbols that
    # `replaces` names: a vLLM whose seam has another is left unpatched, never patched blind.
    fits: Mapping[str, str] = field(default_factory=dict)
    # How the seam differs between the releases in `fits`, where it does.
    differs: str = ""
    # The patches it is wrong without: applied first, and it is left unapplied without them.
    requires: tuple[str, ...] = ()
    # What of the vLLM internals it relies on differs here; None when nothing does.
    check: Callable[[ModuleType], str | None] = lambda target: None
    # vLLM imports its target on every platform; should that fail off ROCm, it does not matter.
    rocm_only: bool = False


def _impl_buffer(layer: Any) -> Any:
    return layer.impl.topk_indices_buffer


def _set_impl_buffer(layer: Any, buffer: Any) -> None:
    layer.impl.topk_indices_buffer = buffer


# A layer's `topk_indices_buffer`, read and assigned through its sparse MLA impl's: the layer's
# writers take the buffer its impl resolves per microbatch, and the MTP proposer's re-pointing
# reaches the impl.
IMPL_TOPK_INDICES_BUFFER = property(_impl_buffer, _set_impl_buffer)


def call_after_init(cls: type, hook: Callable[[Any], None]) -> None:
    """Run `hook(instance)` after `cls.__init__`, keeping its signature."""
    stock_init = cls.__init__

    @functools.wraps(stock_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        stock_init(self, *args, **kwargs)
        hook(self)

    __init__.after_init = hook
    cls.__init__ = __init__


def run_after_init(instance: Any) -> None:
    """The hooks `call_after_init` hung on `type(instance)`, for an instance
    built without `__init__` (the demo's attention modules)."""
    init = type(instance).__init__
    hooks = []
    while hasattr(init, "after_init"):
        hooks.append(init.after_init)
        init = init.__wrapped__
    for hook in reversed(hooks):
        hook(instance)


def replace_function(module: ModuleType, name: str, replacement: Callable) -> None:
    """Set `module.name` to `replacement`, and every module's alias of the stock one.

    Modules that imported the function by value before this call hold the
    stock function under the same name; they get the replacement too.
    """
    stock = getattr(module, name)
    for holder in list(sys.modules.values()):
        # The module's own dict: a module-level __getattr__ may import or raise.
        if getattr(holder, "__dict__", {}).get(name) is stock:
            setattr(holder, name, replacement)
    setattr(module, name, replacement)


def unset_attributes(fn: Callable, *names: str) -> str | None:
    """None when `fn`'s code names every attribute in `names`, else which it does not."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    missing = [n for n in names if code is None or n not in code.co_names]
    return f"{fn.__qualname__} no longer sets {missing}" if missing else None


def where(function: Any) -> str:
    """Where `function` (or a property's getter) is defined, for a message naming it:
    functools.wraps gives a wrapper the wrapped one's names, not its code."""
    code = getattr(getattr(function, "fget", function), "__code__", None)
    if code is None:
        return repr(function)
    return f"{code.co_name} at {code.co_filename}:{code.co_firstlineno}"
