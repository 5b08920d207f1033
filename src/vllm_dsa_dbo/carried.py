"""What this vLLM carries of the upstream change (vllm PR #60734, as `upstream-patch` writes
it), seam by seam: the one place the plugin asks.

A seam carries the change where vLLM's own code has the change's structure there: the
attributes it gives a class, and the calls and stores that hand a top-k buffer on. A line
that only mentions a buffer does not count. A tree carrying the change in part is trusted
per model path: all of the change there or none of it (docs/UPSTREAM.md).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any

Classes = Mapping[str, ast.ClassDef]


class Form(Enum):
    """How one seam of this vLLM stands."""

    RELEASED = "as released"
    CARRIED = "carries the change"
    CHANGED = "changed"


@dataclass(frozen=True)
class Seam:
    """A vLLM file the change edits, and what its classes show when they carry the change."""

    path: str
    carries: str
    shows: Callable[[Classes], bool]
    # Every DSA model runs the core; a model's own files only that model.
    core: bool = False

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


def _methods(cls: ast.ClassDef | None) -> dict[str, ast.FunctionDef]:
    body = [] if cls is None else cls.body
    return {n.name: n for n in body if isinstance(n, ast.FunctionDef)}


def _calls(node: ast.AST | None) -> set[str]:
    """What `node` calls, as written."""
    found = () if node is None else ast.walk(node)
    return {ast.unparse(n.func) for n in found if isinstance(n, ast.Call)}


def _params(fn: ast.FunctionDef | None) -> set[str]:
    return set() if fn is None else {a.arg for a in (*fn.args.args, *fn.args.kwonlyargs)}


def _keeps_state_per_ubatch(classes: Classes) -> bool:
    group, builder = classes.get("SparseMLAIndexGroup"), classes.get("SparseMLAIndexGroupBuilder")
    fields = {
        ast.unparse(n.target) for n in getattr(group, "body", ()) if isinstance(n, ast.AnnAssign)
    }
    methods, building = _methods(group), _methods(builder)
    reads = set().union(*map(_calls, methods.values()))
    return (
        "ubatch_topk" in fields
        and {"_topk_state", "ubatch_topk_rows"} <= methods.keys()
        and {"self._topk_state", "self.ubatch_topk_rows"} <= reads
        and "num_ubatches" in _params(building.get("__init__"))
        and "self._add_ubatch_topk" in _calls(building.get("register_layer"))
    )


def _getter_resolves_rows(classes: Classes) -> bool:
    cls = classes.get("SharedTopkIndicesBuffer")
    getters = [
        n
        for n in getattr(cls, "body", ())
        if isinstance(n, ast.FunctionDef)
        and n.name == "topk_indices_buffer"
        and "property" in map(ast.unparse, n.decorator_list)
    ]
    return any(
        isinstance(r, ast.Return)
        and isinstance(r.value, ast.Call)
        and ast.unparse(r.value.func) == "self.index_group.ubatch_topk_rows"
        for getter in getters
        for r in ast.walk(getter)
    )


def _buffers_handed_on(cls: ast.ClassDef | None) -> set[str]:
    """The top-k buffers `cls`'s methods, `__init__` aside, pass to a call: each as written, a
    local name as the method assigned it."""
    found = set()
    for name, method in _methods(cls).items():
        if name == "__init__":
            continue
        local = {
            t.id: ast.unparse(n.value)
            for n in ast.walk(method)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for call in (n for n in ast.walk(method) if isinstance(n, ast.Call)):
            for arg in (*call.args, *(k.value for k in call.keywords)):
                text = ast.unparse(arg)
                if isinstance(arg, (ast.Name, ast.Attribute)) and text.endswith(
                    "topk_indices_buffer"
                ):
                    found.add(local.get(text, text) if isinstance(arg, ast.Name) else text)
    return found


def _hands_on(cls: str, buffer: str) -> Callable[[Classes], bool]:
    """`cls`'s writers get `buffer` (the impl's, resolved per microbatch), and nothing else."""
    return lambda classes: _buffers_handed_on(classes.get(cls)) == {buffer}


def _op_takes_each_calls_buffer(classes: Classes) -> bool:
    for method in _methods(classes.get("MistralIndexer")).values():
        for node in ast.walk(method):
            if (
                isinstance(node, ast.Assign)
                and [ast.unparse(t) for t in node.targets]
                == ["self.indexer_op.topk_indices_buffer"]
                and isinstance(node.value, ast.Name)
                and node.value.id in _params(method)
            ):
                return True
    return False


def _counts_ubatches(cls: str) -> Callable[[Classes], bool]:
    """`cls` builds its index groups for the run's microbatch count."""

    def shows(classes: Classes) -> bool:
        node = classes.get(cls)
        builds = [] if node is None else [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        return any(
            ast.unparse(call.func).endswith("SparseMLAIndexGroupBuilder")
            and "get_num_ubatches" in _calls(call)
            for call in builds
        )

    return shows


# By the plugin's patch of the seam where it has one.
SEAMS = {
    "index_group": Seam(
        "vllm/v1/attention/backends/mla/index_group.py",
        "SparseMLAIndexGroup keeps its top-k state per microbatch (ubatch_topk, _topk_state, "
        "ubatch_topk_rows) where SparseMLAIndexGroupBuilder is given num_ubatches",
        _keeps_state_per_ubatch,
        core=True,
    ),
    "sparse_mla_attention": Seam(
        "vllm/model_executor/layers/attention/sparse_mla_attention.py",
        "SharedTopkIndicesBuffer.topk_indices_buffer returns its group's ubatch_topk_rows",
        _getter_resolves_rows,
        core=True,
    ),
    "deepseek_v32_attention": Seam(
        "vllm/models/deepseek_v32/attention.py",
        "DeepseekV32Attention's writers take the impl's topk_indices_buffer",
        _hands_on("DeepseekV32Attention", "self.impl.topk_indices_buffer"),
    ),
    "deepseek_v32_model": Seam(
        "vllm/models/deepseek_v32/nvidia/model.py",
        "DeepseekV32Model gives its index groups the run's microbatch count",
        _counts_ubatches("DeepseekV32Model"),
    ),
    "mistral_attention": Seam(
        "vllm/models/mistral/nvidia/attention.py",
        "MistralMLAAttention's writers take the impl's topk_indices_buffer",
        _hands_on("MistralMLAAttention", "self.attn.impl.topk_indices_buffer"),
    ),
    "mistral_indexer": Seam(
        "vllm/models/mistral/nvidia/indexer.py",
        "MistralIndexer gives its op the topk_indices_buffer of each call",
        _op_takes_each_calls_buffer,
    ),
    "mistral_large4_model": Seam(
        "vllm/models/mistral/mistral_large4/nvidia/model.py",
        "MistralLarge4Model gives its index groups the run's microbatch count",
        _counts_ubatches("MistralLarge4Model"),
    ),
}


@functools.cache
def found() -> dict[str, bool]:
    """Per seam whose file this vLLM has, whether it carries the change; read once."""
    import vllm

    return found_in(Path(vllm.__file__).parents[1])


def found_in(root: Path) -> dict[str, bool]:
    """Per seam whose file the vLLM source tree at `root` has, whether it carries the change."""
    result = {}
    for name, seam in SEAMS.items():
        try:
            tree = ast.parse((root / seam.path).read_text(encoding="utf-8"))
        except OSError:  # not in this release (Mistral Large 4 before 0.34.0)
            continue
        except (SyntaxError, UnicodeDecodeError):
            result[name] = False
            continue
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        result[name] = seam.shows(classes)
    return result


def carries(name: str) -> str | None:
    """What this vLLM's code has of the change at seam `name`; None where it lacks it."""
    return SEAMS[name].carries if found().get(name) else None


def own_groups() -> bool:
    """Whether vLLM's own index groups keep top-k per microbatch (the change's index_group.py):
    they then hold vLLM's per-microbatch state, not the plugin's."""
    return found().get("index_group", False)


def seam_digest(target: ModuleType, replaces: tuple[str, ...]) -> str:
    """sha256 (16 hex digits) of the source of each of `target`'s symbols that `replaces` names."""
    digest = hashlib.sha256()
    for name in sorted({symbol.split(".")[0] for symbol in replaces}):
        digest.update(inspect.getsource(getattr(target, name)).encode())
    return digest.hexdigest()[:16]


def form(
    name: str, target: ModuleType, replaces: tuple[str, ...], release: str, expected: str
) -> tuple[Form, str]:
    """How the seam a patch named `name` sets `replaces` on stands here, and what shows it."""
    if name in SEAMS and (carried := carries(name)):
        return Form.CARRIED, carried
    try:
        digest = seam_digest(target, replaces)
    except (OSError, TypeError) as e:  # no source: nothing shows the seam is the release's
        return Form.CHANGED, f"{target.__name__}: no source to compare with vLLM {release}'s ({e})"
    if digest != expected:
        return Form.CHANGED, (
            f"{target.__name__} differs from vLLM {release}'s where the patch sets "
            f"{', '.join(replaces)} (seam sha256 {digest}, expected {expected})"
        )
    return Form.RELEASED, f"its seam is vLLM {release}'s (sha256 {digest})"


def _lacked_in_a_mix(has: dict[str, bool]) -> list[str]:
    """The files of the seams in `has` that lack the change, where others carry it."""
    if all(has.values()) or not any(has.values()):
        return []
    return [SEAMS[name].path for name, carried in has.items() if not carried]


def lacked() -> list[str]:
    """The change's files this vLLM lacks where it carries the change in part."""
    return _lacked_in_a_mix(found())


def unvouched(model: Any) -> list[str]:
    """The change's files on `model`'s path (the core's, and those of its layers' classes)
    that this vLLM lacks, where it carries others there: a mix the plugin does not vouch for."""
    modules = {type(m).__module__ for m in model.modules()}
    on_path = {n for n, seam in SEAMS.items() if seam.core or seam.module in modules}
    return _lacked_in_a_mix({n: has for n, has in found().items() if n in on_path})
