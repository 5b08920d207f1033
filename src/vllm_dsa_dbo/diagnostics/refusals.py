"""The load-time refusals: models whose followers would read another microbatch's top-k."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_dsa_dbo import carried
from vllm_dsa_dbo.patches import overridden
from vllm_dsa_dbo.settings import refusal
from vllm_dsa_dbo.ubatch_buffers import stored_buffer, ubatch_copies

if TYPE_CHECKING:
    import torch
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

T = TypeVar("T")


def index_groups(model: torch.nn.Module) -> list[SparseMLAIndexGroup]:
    """The distinct index groups of a model's sparse MLA impls."""
    groups: dict[int, SparseMLAIndexGroup] = {}
    for module in model.modules():
        group = getattr(getattr(module, "impl", None), "index_group", None)
        if group is not None:
            groups.setdefault(id(group), group)
    return list(groups.values())


def reads_another_layers_topk(group: SparseMLAIndexGroup) -> bool:
    """A group with followers, or a follower's group of its own."""
    return group.num_layers > 1 or not group.has_indexer


def ubatch_count(group: Any) -> int:
    """The microbatches `group` keeps top-k for: a vLLM carrying the upstream change's
    `ubatch_topk`, one per microbatch, else the plugin's logical buffer's once followed."""
    if getattr(group, "ubatch_topk", ()):
        return len(group.ubatch_topk)
    extra = getattr(group, "ubatch_logical_topk", None)
    return extra.num_ubatches if extra is not None and extra.followed else 1


def keeps_logical_per_ubatch(group: SparseMLAIndexGroup) -> bool:
    """Whether `group` keeps top-k for extra microbatches."""
    return ubatch_count(group) > 1


def followed_groups(groups: list[SparseMLAIndexGroup]) -> list[SparseMLAIndexGroup]:
    """The groups that read another layer's top-k and keep it per microbatch
    (a group with followers, or a single-layer follower group of HYV4 / ROCm DSA)."""
    return [g for g in groups if keeps_logical_per_ubatch(g) and reads_another_layers_topk(g)]


def shares_topk_across_ubatches(group: SparseMLAIndexGroup) -> bool:
    """Whether, under DBO, a layer of `group` (with followers, or a follower's own) would read
    a top-k another layer wrote into state its leader's writers do not keep per microbatch."""
    if group.num_ubatches < 2 or not reads_another_layers_topk(group):
        return False
    kept = group.ubatch_topk_states if group.num_layers > 1 else keeps_logical_per_ubatch(group)
    return not (kept and group.leader_writes_follow_impl)


def left_shared(group: Any, num_ubatches: int) -> bool:
    """`shares_topk_across_ubatches`, also for a group built for fewer microbatches than the
    run has (vLLM's own, index_group unapplied, or a builder given a smaller count).

    A vLLM that carries the upstream change keeps a group's state in `ubatch_topk`, one entry
    per microbatch, where its model passed the count: its own fixed writers', or those the
    mla patch wires. A follower's private group (HYV4, ROCm DSA) needs only a logical buffer
    its leader's writers resolve, in either form."""
    if carried.own_groups():
        if num_ubatches < 2 or not reads_another_layers_topk(group):
            return False
        if group.num_layers > 1:
            return len(group.ubatch_topk) < num_ubatches
        return ubatch_count(group) < num_ubatches or not getattr(
            group, "leader_writes_follow_impl", False
        )
    if getattr(group, "num_ubatches", 1) < num_ubatches:
        return reads_another_layers_topk(group)
    return hasattr(group, "ubatch_topk_states") and shares_topk_across_ubatches(group)


def reuses_topk(attn: Any) -> bool:
    """A DeepSeek-V4.1 layer that reads the top-k of an index source below it."""
    source = getattr(attn, "index_source_layer_id", None)
    return source is not None and source != getattr(attn, "layer_id", source)


def reads_candidates(attn: Any) -> bool:
    """A DeepSeek-V4.1 indexer that masks its scores with an earlier layer's candidates."""
    layer_id = getattr(attn, "layer_id", None)
    source = getattr(attn, "candidate_source_layer", -1)
    return (
        getattr(attn, "indexer", None) is not None
        and layer_id is not None
        and 0 <= source < layer_id
        # DeepseekV4Model allocates none without candidate_topk_blocks.
        and stored_buffer(attn, "candidate_block_buffer") is not None
    )


def hands_topk_outside_index_groups(module: Any) -> bool:
    """A layer reading top-k state another layer wrote outside index groups, in a model-wide
    buffer without per-microbatch copies (DeepSeek-V4.1's top-k and candidate blocks off
    CUDA; MiniMax-M3's `skip_index_topk` layers on ROCm)."""
    if getattr(module, "skip_index_topk", False) is True:
        return True
    if reuses_topk(module) and not ubatch_copies(stored_buffer(module, "topk_indices_buffer")):
        return True
    return reads_candidates(module) and not ubatch_copies(
        stored_buffer(module, "candidate_block_buffer")
    )


def reads_topk_without_index_group(module: Any) -> bool:
    """A follower's sparse MLA impl that reads the model-wide logical top-k with
    no index group to resolve it per microbatch (XPU_MLA_SPARSE builds none)."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SharedTopkIndicesBuffer,
    )

    impl = getattr(module, "impl", None)
    return (
        isinstance(impl, SharedTopkIndicesBuffer)
        and getattr(impl, "index_group", None) is None
        and impl.topk_indices_buffer is not None
        # MLAAttention keeps its layer's indexer: None on a follower.
        and getattr(module, "indexer", False) is None
    )


def sparse_mla_backend(module: Any) -> str:
    """vLLM's name for the backend of `module`'s impl, as `--attention-backend` takes it."""
    backend = getattr(module, "attn_backend", None)
    return type(module.impl).__name__ if backend is None else backend.get_name()


def as_ubatch(ubatch_id: int, read: Callable[[], T]) -> T:
    """`read()` in a thread registered as DBO microbatch `ubatch_id`, as DBO registers its own,
    with a context at token offset `ubatch_id` where none is set (a row of its own)."""
    from vllm.v1.worker import ubatching

    found: list[Any] = []

    def run() -> None:
        registry = ubatching._THREAD_ID_TO_CONTEXT
        registry[threading.get_ident()] = ubatch_id
        try:
            found.append(read())
        except BaseException as e:  # raised again in the caller
            found.append(e)
        finally:
            registry.pop(threading.get_ident(), None)

    contexts = ubatching._CURRENT_CONTEXTS
    saved = list(contexts)
    contexts.extend([None] * (ubatch_id + 1 - len(contexts)))
    if contexts[ubatch_id] is None:
        contexts[ubatch_id] = SimpleNamespace(token_offset=ubatch_id)
    thread = threading.Thread(target=run, name=f"vllm-dsa-dbo-probe-{ubatch_id}")
    try:
        thread.start()
        thread.join()
    finally:
        contexts[:] = saved
    if isinstance(found[0], BaseException):
        raise found[0]
    return found[0]


def _address(tensor: Any) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def class_syntax(cls: type) -> ast.Module | None:
    """`cls`'s code as a syntax tree; None where it has no source to read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None


@functools.cache
def reads_own_buffer(cls: type) -> bool:
    """Whether vLLM's code of `cls` reads `self.topk_indices_buffer`, as released leaders'
    writers do (a property the fix installs, or a plain attribute); a class without source
    counts as reading it."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vllm."):
            continue
        tree = class_syntax(klass)
        if tree is None:
            return True
        if any(
            isinstance(node, ast.Attribute)
            and node.attr == "topk_indices_buffer"
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) == "self"
            for node in ast.walk(tree)
        ):
            return True
    return False


def resolved_topk(model: Any, group: Any) -> dict[str, int | None]:
    """Where the calling microbatch's forward finds `group`'s top-k: each layer's impl getter
    (the leader's writers and the followers' readers), a module's own buffer where its code
    reads it and a writer the fix gave the group (the leader's writers), and, for a group
    with followers, the converted state (a one-layer group converts within its layer)."""
    found: dict[str, int | None] = {}
    for name, module in model.named_modules():
        if getattr(module, "index_group", None) is group:
            found[name] = _address(module.topk_indices_buffer)
        impl = getattr(module, "impl", None)
        if getattr(impl, "index_group", None) is not group:
            continue
        found[f"{name}.impl"] = _address(impl.topk_indices_buffer)
        if reads_own_buffer(type(module)):
            found[name] = _address(module.topk_indices_buffer)
    if group.num_layers > 1:
        if carried.own_groups():  # vLLM's own: its rows at the token offset
            physical = group.ubatch_topk_rows(group.physical_topk_indices)
        else:
            physical = getattr(group, "_topk_state", lambda: group)().physical_topk_indices
        found["physical"] = _address(physical)
    return found


def hands_topk(group: Any) -> bool:
    """Whether another layer reads the top-k `group`'s layers write or read: a group with
    followers, a follower's own, or a leader's own that hands it to such (HYV4, ROCm DSA)."""
    return reads_another_layers_topk(group) or (
        keeps_logical_per_ubatch(group) and getattr(group, "leader_writes_follow_impl", False)
    )


def unresolved(model: Any) -> str | None:
    """None when, through the getters the forward uses, each index group that hands top-k to
    another layer resolves microbatch 1 to one state of its own, else what does not."""
    groups = index_groups(model)
    if not any(reads_another_layers_topk(g) for g in groups):
        return None
    for group in filter(hands_topk, groups):
        read = functools.partial(resolved_topk, model, group)
        zero, one = as_ubatch(0, read), as_ubatch(1, read)
        logical = {k: v for k, v in one.items() if k != "physical"}
        if len(set(logical.values())) > 1:
            return f"in microbatch 1, its layers' getters resolve different buffers ({logical})"
        shared = [k for k in one if one[k] == zero[k]]
        if shared:
            return f"microbatch 1 resolves microbatch 0's top-k at {', '.join(shared)}"
    return None


def lacked_change() -> str | None:
    """What this vLLM lacks of the upstream change where it carries the change in part."""
    lacked = carried.lacked()
    if not lacked:
        return None
    return (
        "this vLLM carries the upstream change (vllm PR #60734) in part: it lacks the change "
        f"to {', '.join(lacked)}"
    )


def sentence(text: str | None) -> str:
    """`text`, if any, as a sentence of a longer message."""
    return f"{text[0].upper()}{text[1:]}. " if text else ""


def check_wired(model: Any, num_ubatches: int = 1) -> None:
    """Refuse DBO for a model whose leaders write the shared top-k elsewhere."""
    shares = any(reads_another_layers_topk(g) for g in index_groups(model))
    if num_ubatches > 1 and shares and (mixed := carried.unvouched(model)):
        raise refusal(
            f"{type(model).__name__} shares top-k between layers, and {lacked_change()}. "
            f"Its layers run files that carry the change and {', '.join(mixed)}, which do not: "
            "the plugin vouches for all of the change on a model's path or none of it.",
            " for this model, or take the whole change",
        )
    if num_ubatches > 1 and (
        ungrouped := [m for m in model.modules() if reads_topk_without_index_group(m)]
    ):
        raise refusal(
            f"{type(model).__name__} shares top-k between layers, but its "
            f"sparse MLA backend {sparse_mla_backend(ungrouped[0])} keeps no index "
            "groups: every follower layer reads the one model-wide top-k buffer in "
            "every microbatch, so with dual batch overlap it would read the other "
            "microbatch's top-k.",
            ", or on CUDA leave --attention-backend unset or pick FLASH_ATTN_MLA_SPARSE, "
            "FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE_SM90 (Hopper), "
            "FLASHINFER_MLA_SPARSE or FLASH_ATTN_MLA_SPARSE_FA4 (Blackwell)",
        )
    if num_ubatches > 1 and any(hands_topk_outside_index_groups(m) for m in model.modules()):
        raise refusal(
            f"{type(model).__name__} hands top-k (or candidate blocks) "
            "from one layer to later layers in buffers that are not index groups "
            "(DeepSeek-V4.1 index_source_layer_ids / candidate_source_layer_id on "
            "ROCm, vllm/models/deepseek_v41/amd; MiniMax-M3 use_index_cache on ROCm), "
            "which the plugin does not keep per microbatch (it does for DeepSeek-V4.1 "
            "on CUDA, vllm/models/deepseek_v41/nvidia). With dual batch overlap "
            "those layers would read the "
            "other microbatch's selection."
        )
    if any(left_shared(g, num_ubatches) for g in index_groups(model)):
        raise refusal(
            f"{type(model).__name__} shares top-k between layers "
            "(index_topk_freq > 1, an index_topk_pattern or a 'shared' index_sharing), "
            "but on this code path "
            "its leader layers write the top-k without going through the "
            "per-microbatch buffers (covered: vLLM's DeepSeek-V3.2 / GLM-5 paths, "
            "vllm/models/deepseek_v32/nvidia and amd, HYV4 on CUDA, "
            "vllm/models/hy_v4/nvidia, Mistral Large 4 on CUDA, "
            "vllm/models/mistral/nvidia, and the compiled deepseek_v2 / glm4_moe_lite "
            "DSA path on CUDA). With dual batch "
            "overlap its followers would read the other microbatch's top-k "
            "(where a vllm-dsa-dbo patch was left unapplied, a warning at startup "
            f"and `vllm-dsa-dbo status` say why). {sentence(lacked_change())}".rstrip()
        )
    if num_ubatches > 1 and (differs := unresolved(model)) is not None:
        cause = (
            lacked_change()
            or "; ".join(overridden())
            or "something replaced a getter the fix installed (another plugin?)"
        )
        raise refusal(
            f"{type(model).__name__} shares top-k between layers, but a "
            f"microbatch-1 thread at load finds that {differs}: {cause}; with dual batch "
            "overlap its followers would read the other microbatch's top-k.",
            " for this model, or the plugin that replaces it",
        )
