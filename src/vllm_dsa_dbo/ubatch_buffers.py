"""Per-DBO-microbatch copies of model-wide buffers that one layer writes and a
later layer reads (DeepSeek-V4.1's top-k and candidate blocks).

A model registers such a buffer once, at construction, with one copy per
extra microbatch. Every module attribute that holds the buffer is a
`PerUbatchBuffer`: it keeps the buffer it was given and hands the calling
microbatch's copy to whoever reads it, writer or reader. Microbatch 0, any
thread outside DBO, and any buffer nobody registered get the stored tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_dsa_dbo.core import current_ubatch_id

# id(buffer) -> (buffer, its copies for microbatches 1..n-1). The buffer is
# kept so its id is never reused while the entry lives.
_COPIES: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}


def resolve_buffer(buffer: Any) -> Any:
    """The calling microbatch's copy of `buffer`, or `buffer` itself."""
    ubatch_id = current_ubatch_id()
    if ubatch_id == 0:
        return buffer
    entry = _COPIES.get(id(buffer))
    return buffer if entry is None else entry[1][ubatch_id - 1]


def add_ubatch_copies(buffer: torch.Tensor, num_extra: int) -> list[torch.Tensor]:
    """Register `num_extra` copies of `buffer`, shaped like it; once per buffer."""
    if id(buffer) in _COPIES:
        return _COPIES[id(buffer)][1]
    copies = [torch.empty_like(buffer) for _ in range(num_extra)]
    _COPIES[id(buffer)] = (buffer, copies)
    return copies


def ubatch_copies(buffer: Any) -> list[torch.Tensor]:
    """The registered copies of `buffer`; none for an unregistered one."""
    entry = _COPIES.get(id(buffer))
    return [] if entry is None else entry[1]


class PerUbatchBuffer:
    """Attribute whose reads resolve a registered buffer per microbatch.

    Assignment stores the tensor as is, so code that rebinds the attribute
    at run time (vLLM's indexer API) keeps working; a rebound tensor that is
    not registered resolves to itself.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.slot = f"_{name}_ubatch0"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return resolve_buffer(obj.__dict__.get(self.slot))

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = value

    def stored(self, obj: Any) -> Any:
        """What was assigned, unresolved."""
        return obj.__dict__.get(self.slot)


def per_ubatch_buffers(cls: type, *names: str) -> None:
    """Make each attribute `names` of `cls` a `PerUbatchBuffer`."""
    for name in names:
        setattr(cls, name, PerUbatchBuffer(name))


def stored_buffer(obj: Any, name: str) -> Any:
    """`obj.name` as assigned, before any per-microbatch resolution."""
    attr = getattr(type(obj), name, None)
    return attr.stored(obj) if isinstance(attr, PerUbatchBuffer) else getattr(obj, name, None)
