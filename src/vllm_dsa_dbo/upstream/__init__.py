"""`vllm-dsa-dbo upstream-patch`: the fix as a change to a vLLM source tree.

Every place is found by the structure of vLLM's code (class, method,
parameter, call and return names), never by line numbers; the inserted code is
taken by symbol name from the plugin's own modules (`TAKEN`). All files are
edited in memory first: a missing or already changed place stops the run
before anything is written.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

INDEX_GROUP = "vllm/v1/attention/backends/mla/index_group.py"
SPARSE_MLA = "vllm/model_executor/layers/attention/sparse_mla_attention.py"
DSV32_ATTENTION = "vllm/models/deepseek_v32/attention.py"
DSV32_MODEL = "vllm/models/deepseek_v32/nvidia/model.py"
NEW_TEST = "tests/v1/attention/test_sparse_mla_dbo_ubatch.py"
INDEX_GROUP_MODULE = "vllm.v1.attention.backends.mla.index_group"

# Where the inserted code comes from, by symbol name: one source of truth.
CORE = "vllm_dsa_dbo.core"
TAKEN = {
    # vLLM file: the core symbols it gets (with the core symbols they use)
    INDEX_GROUP: (
        "UBATCH_TOPK_FIELDS",
        "UbatchTopkField",
        "topk_state",
        "resolve_logical_topk",
        "init_builder_state",
        "add_layer_state",
    ),
}
HISPARSE_REFUSAL = ("vllm_dsa_dbo.patches.index_group", "apply.register_layer")
LEADER_BUFFER = ("vllm_dsa_dbo.patches.deepseek_v32_attention", "_get", "_set")
MAX_COLUMNS = 88  # vLLM's line length


class PatchRefused(Exception):
    """A place the fix goes is missing or already changed: nothing was written."""

    def __init__(self, path: str, place: str, why: str) -> None:
        super().__init__(f"{path}: {place}: {why}")


@dataclass
class Source:
    """One vLLM file, parsed once, with the edits planned in it."""

    path: str
    text: str
    tree: ast.Module = field(init=False)
    edits: list[tuple[int, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tree = ast.parse(self.text)
        self._line_starts = [0]
        for line in self.text.splitlines(keepends=True):
            self._line_starts.append(self._line_starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        return self._line_starts[lineno - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)

    def line_end(self, node: ast.AST) -> int:
        """The offset just past the newline of `node`'s last line."""
        return self._line_starts[node.end_lineno]

    def segment(self, node: ast.AST) -> str:
        return self.text[self.start(node) : self.end(node)]

    def refuse(self, place: str, why: str) -> PatchRefused:
        return PatchRefused(self.path, place, why)

    def find(self, dotted: str) -> ast.ClassDef | ast.FunctionDef:
        """The class or function at `dotted` (`Class.method`), else a refusal."""
        scope: ast.AST = self.tree
        for depth, name in enumerate(dotted.split(".")):
            found = [
                n
                for n in getattr(scope, "body", [])
                if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name
            ]
            if len(found) != 1:
                where = ".".join(dotted.split(".")[:depth]) or "the module"
                raise self.refuse(dotted, f"{where} defines {len(found)} {name!r}, expected 1")
            scope = found[0]
        return scope

    def replace(self, start: int, end: int, text: str) -> None:
        self.edits.append((start, end, text))

    def insert(self, at: int, text: str) -> None:
        self.edits.append((at, at, text))

    def patched(self) -> str:
        """The text with every edit; edits at one offset land in the order they were made."""
        ordered = sorted(enumerate(self.edits), key=lambda e: (e[1][0], e[1][1], e[0]))
        spans = [(start, end) for _, (start, end, _) in ordered]
        if any(s < e for (_, e), (s, _) in zip(spans, spans[1:], strict=False)):
            raise self.refuse("edits", "two edits overlap (a bug in upstream-patch)")
        text = self.text
        for _, (start, end, new) in reversed(ordered):
            text = text[:start] + new + text[end:]
        return text


def module_source(name: str) -> Source:
    """A plugin module's source, read without importing it (which would import vLLM)."""
    path = importlib.util.find_spec(name).origin
    return Source(path, Path(path).read_text())


def top_level(source: Source) -> dict[str, ast.stmt]:
    """Each name a module binds at top level (def, class, assignment) and its statement."""
    bound: dict[str, ast.stmt] = {}
    for node in source.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = node
    return bound


def imported(source: Source) -> dict[str, ast.stmt]:
    """Each name a module's top-level imports bind, and the import binding it."""
    names: dict[str, ast.stmt] = {}
    for node in source.tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def used_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def statement_text(source: Source, node: ast.stmt) -> str:
    """`node`'s whole lines, decorators included."""
    return source.text[source.offset(first_line(node), 0) : source.line_end(node)]


def core_closure(core: Source, wanted: tuple[str, ...]) -> tuple[list[ast.stmt], set[str]]:
    """The statements defining `wanted` and every core symbol they use, in
    core's order, and the names they bind."""
    bound = top_level(core)
    seen: set[str] = set()
    todo = list(wanted)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in bound:
            raise core.refuse(name, "no such top-level symbol in the core module")
        seen.add(name)
        todo += [n for n in used_names(bound[name]) if n in bound]
    keep = {id(bound[name]) for name in seen}
    names = {name for name, node in bound.items() if id(node) in keep}
    return [node for node in core.tree.body if id(node) in keep], names


def import_line(node: ast.stmt, name: str) -> str:
    """The import statement binding only `name`, from `node` which binds it."""
    alias = next(a for a in node.names if (a.asname or a.name).split(".")[0] == name)
    spelled = alias.name + (f" as {alias.asname}" if alias.asname else "")
    if isinstance(node, ast.Import):
        return f"import {spelled}"
    return f"from {'.' * node.level}{node.module} import {spelled}"


def import_key(node: ast.stmt) -> tuple[int, bool, str]:
    """Where ruff's isort puts an import: its section, plain imports first, then by module."""
    module = node.names[0].name if isinstance(node, ast.Import) else node.module or ""
    top = module.split(".")[0]
    section = (
        0
        if top == "__future__"
        else 1
        if top in sys.stdlib_module_names
        else 3
        if top == "vllm"
        else 2
    )
    return section, isinstance(node, ast.ImportFrom), module


def add_imports(target: Source, lines: list[str]) -> None:
    """Add `lines` to `target`'s top-level imports: a name into the module's
    existing `from` import, else a new line where isort would put it."""
    imports = [n for n in target.tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    if not imports:
        raise target.refuse("imports", "the module has no top-level imports")
    merged: dict[int, set[str]] = {}
    for line in sorted(lines):
        new = ast.parse(line).body[0]
        same = [
            n
            for n in imports
            if isinstance(new, ast.ImportFrom)
            and isinstance(n, ast.ImportFrom)
            and n.module == new.module
            and n.level == new.level == 0
            and all(a.asname is None for a in n.names + new.names)
        ]
        if same:
            merged.setdefault(id(same[0]), {a.name for a in same[0].names}).add(new.names[0].name)
            continue
        key = import_key(new)
        peers = [n for n in imports if import_key(n)[0] == key[0]]
        later = [n for n in peers if import_key(n) > key]
        if later:
            target.insert(target.offset(first_line(later[0]), 0), line + "\n")
        elif peers:
            target.insert(target.line_end(peers[-1]), line + "\n")
        else:
            raise target.refuse("imports", f"no import section to put {line!r} in")
    for node in imports:
        if id(node) in merged:
            text = from_import(node.module, merged[id(node)])
            target.replace(target.start(node), target.end(node), text)


def from_import(module: str, names: set[str]) -> str:
    one_line = f"from {module} import {', '.join(sorted(names))}"
    if len(one_line) <= MAX_COLUMNS:
        return one_line
    body = "".join(f"    {n},\n" for n in sorted(names))
    return f"from {module} import (\n{body})"


def first_line(node: ast.stmt) -> int:
    """`node`'s first line, its decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def needed_imports(target: Source, core: Source, nodes: list[ast.stmt]) -> list[str]:
    """Core's imports of the names `nodes` use that `target` does not bind."""
    have = imported(target) | top_level(target)
    core_imports = imported(core)
    used = set().union(*(used_names(n) for n in nodes))
    names = [n for n in sorted(used) if n in core_imports and n not in have]
    return [import_line(core_imports[n], n) for n in names]


def taken_code(target: Source, wanted: tuple[str, ...]) -> tuple[str, list[str]]:
    """The core statements `wanted` needs, as text, and the imports they need in `target`."""
    core = module_source(CORE)
    nodes, names = core_closure(core, wanted)
    clash = sorted(names & set(top_level(target)))
    if clash:
        raise target.refuse(
            ", ".join(clash), "already defined here: the tree carries the fix (or part of it)"
        )
    text = "\n\n".join(statement_text(core, n).rstrip("\n") + "\n" for n in nodes)
    return text, needed_imports(target, core, nodes)


def nested_function(source: Source, dotted: str) -> ast.FunctionDef:
    """The function at `dotted`, where a part may be a function nested in the previous one."""
    scope: ast.AST = source.tree
    for name in dotted.split("."):
        scope = next(
            (
                n
                for n in ast.walk(scope)
                if isinstance(n, ast.FunctionDef) and n.name == name and n is not scope
            ),
            None,
        )
        if scope is None:
            raise source.refuse(dotted, f"no function {name!r}")
    return scope


def reindented(source: Source, node: ast.stmt, indent: str) -> str:
    return textwrap.indent(textwrap.dedent(statement_text(source, node)), indent)


def body_start(source: Source, fn: ast.FunctionDef) -> ast.stmt:
    """`fn`'s first statement after its docstring."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        if len(body) == 1:
            raise source.refuse(fn.name, "has only a docstring")
        return body[1]
    return body[0]


def indent_of(source: Source, node: ast.AST) -> str:
    return " " * node.col_offset


def refuse_parameter_present(source: Source, fn: ast.FunctionDef, place: str, name: str) -> None:
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    if name in params:
        raise source.refuse(place, f"already takes {name}: the tree carries the fix")


def add_keyword_parameter(source: Source, fn: ast.FunctionDef, place: str, parameter: str) -> None:
    """Rewrite `fn`'s parameter list one per line, with `parameter` keyword-only at the end."""
    args = fn.args
    if args.vararg or args.kwarg or args.posonlyargs:
        raise source.refuse(place, "takes *args, **kwargs or positional-only parameters")
    positional = [ast.unparse(a) for a in args.args]
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    texts = [
        p if d is None else f"{p} = {source.segment(d)}"
        for p, d in zip(positional, defaults, strict=True)
    ]
    keyword = [
        ast.unparse(a) if d is None else f"{ast.unparse(a)} = {source.segment(d)}"
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    texts += ["*", *keyword, parameter]
    indent = indent_of(source, fn) + "    "
    first = min(a.lineno for a in args.args)
    open_paren = source.text.index("(", source.offset(fn.lineno, fn.col_offset))
    if first < fn.lineno:
        raise source.refuse(place, "parameters precede the def line")
    last = (
        args.kw_defaults[-1]
        if args.kw_defaults and args.kw_defaults[-1] is not None
        else args.kwonlyargs[-1]
        if args.kwonlyargs
        else args.defaults[-1]
        if args.defaults
        else args.args[-1]
    )
    close_paren = source.text.index(")", source.end(last))
    body = "".join(f"{indent}{t},\n" for t in texts)
    source.replace(open_paren + 1, close_paren, f"\n{body}{indent[:-4]}")


def wrapped_call(prefix: str, function: str, args: list[str], indent: str, comment: str) -> str:
    """`prefix + function(args)`, broken over lines when it runs past vLLM's line
    length; a trailing `comment` stays on the line of the last argument."""
    one_line = f"{indent}{prefix}{function}({', '.join(args)})"
    if len(one_line) <= MAX_COLUMNS:
        return one_line.lstrip() + (f"  {comment}" if comment else "")
    inner = "".join(f"{indent}    {a},\n" for a in args)
    if comment:
        inner = f"{inner[:-1]}  {comment}\n"
    return f"{prefix}{function}(\n{inner}{indent})"


# The edits, file by file ------------------------------------------------------


def patch_index_group(source: Source) -> None:
    group = source.find("SparseMLAIndexGroup")
    init = source.find("SparseMLAIndexGroupBuilder.__init__")
    register = source.find("SparseMLAIndexGroupBuilder.register_layer")
    refuse_parameter_present(source, init, "SparseMLAIndexGroupBuilder.__init__", "num_ubatches")
    code, imports = taken_code(source, TAKEN[INDEX_GROUP])
    add_imports(source, imports)
    # The core code goes before the group class, which it is installed on.
    source.insert(source.offset(first_line(group), 0), code + "\n\n")

    fields = [n for n in group.body if isinstance(n, ast.AnnAssign)]
    if not fields:
        raise source.refuse("SparseMLAIndexGroup", "declares no dataclass fields")
    source.insert(source.line_end(fields[-1]), GROUP_ATTRIBUTES)
    source.insert(source.line_end(group), GROUP_FIELDS)

    add_keyword_parameter(
        source, init, "SparseMLAIndexGroupBuilder.__init__", "num_ubatches: int = 1"
    )
    end = init.body[-1]
    source.insert(source.line_end(end), textwrap.indent(BUILDER_INIT, indent_of(source, end)))

    source.find("HiSparseMLAIndexGroup")  # the refusal names it
    params = [a.arg for a in register.args.args]
    if params[:2] != ["self", "is_index_producing_layer"]:
        raise source.refuse("SparseMLAIndexGroupBuilder.register_layer", f"takes {params}")
    first = body_start(source, register)
    refusal = hisparse_refusal(indent_of(source, first))
    source.insert(source.offset(first.lineno, 0), refusal)

    last = register.body[-1]
    returned = last.value.elts if isinstance(getattr(last, "value", None), ast.Tuple) else []
    if not (
        isinstance(last, ast.Return)
        and len(returned) == 2
        and all(isinstance(e, ast.Name) for e in returned)
    ):
        raise source.refuse(
            "SparseMLAIndexGroupBuilder.register_layer", "does not end in `return group, index`"
        )
    group_name, index_name = (e.id for e in returned)
    tail = BUILDER_REGISTER.format(group=group_name, index=index_name)
    source.insert(source.offset(last.lineno, 0), textwrap.indent(tail, indent_of(source, last)))


GROUP_ATTRIBUTES = '''
    # Extra microbatches' state: set by the builder for groups with followers.
    num_ubatches: int = 1
    ubatch_topk_states: tuple[UbatchTopkState, ...] = ()
    ubatch_logical_topk: UbatchLogicalTopk | None = None
    # In this tree every leader's writers take the logical buffer from the
    # impl (DeepseekV32Attention.topk_indices_buffer), so copies may resolve.
    leader_writes_follow_impl: bool = True

    def _topk_state(self) -> SparseMLAIndexGroup | UbatchTopkState:
        """The state the calling DBO microbatch reads and writes."""
        return topk_state(self)
'''

GROUP_FIELDS = """

# The per-microbatch fields resolve to the calling microbatch's copy.
for _name in UBATCH_TOPK_FIELDS:
    setattr(SparseMLAIndexGroup, _name, UbatchTopkField(_name))
"""

BUILDER_INIT = "init_builder_state(self, num_ubatches)\n"
BUILDER_REGISTER = "add_layer_state(self, {group}, {index})\n"


def hisparse_refusal(indent: str) -> str:
    """The plugin's HiSparse + DBO refusal, raised where the builder sees the follower."""
    module, dotted = HISPARSE_REFUSAL
    plugin = module_source(module)
    raises = [n for n in ast.walk(nested_function(plugin, dotted)) if isinstance(n, ast.Raise)]
    if len(raises) != 1:
        raise plugin.refuse(dotted, f"raises {len(raises)} times, expected the one refusal")
    condition = (
        "if (\n"
        "    self.num_ubatches > 1\n"
        "    and not is_index_producing_layer\n"
        "    and isinstance(self.current_group, HiSparseMLAIndexGroup)\n"
        "):\n"
    )
    return textwrap.indent(condition, indent) + reindented(plugin, raises[0], indent + "    ")


def patch_sparse_mla(source: Source) -> None:
    place = "SharedTopkIndicesBuffer.topk_indices_buffer"
    mixin = source.find("SharedTopkIndicesBuffer")
    getters = [
        n
        for n in mixin.body
        if isinstance(n, ast.FunctionDef)
        and n.name == "topk_indices_buffer"
        and any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)
    ]
    if len(getters) != 1:
        raise source.refuse(place, f"{len(getters)} property getters, expected 1")
    getter = getters[0]
    if "resolve_logical_topk" in used_names(getter):
        raise source.refuse(place, "already resolves per microbatch: the tree carries the fix")
    returns = [n for n in ast.walk(getter) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        raise source.refuse(place, "returns nothing")
    for ret in returns:
        args = ["self.index_group", source.segment(ret.value)]
        line_end = source.line_end(ret) - 1
        comment = source.text[source.end(ret) : line_end].strip()
        end = line_end if comment.startswith("#") else source.end(ret)
        indent = indent_of(source, ret)
        call = wrapped_call("return ", "resolve_logical_topk", args, indent, comment)
        source.replace(source.start(ret), end, call)
    fields = [n for n in mixin.body if isinstance(n, ast.AnnAssign)]
    if not fields:
        raise source.refuse("SharedTopkIndicesBuffer", "declares no class attributes")
    indent = indent_of(source, fields[-1])
    source.insert(
        source.line_end(fields[-1]),
        f"{indent}# The impl's group: its extra microbatches' logical buffers.\n"
        f"{indent}index_group: SparseMLAIndexGroup | None = None\n",
    )
    add_imports(source, [f"from {INDEX_GROUP_MODULE} import resolve_logical_topk"])


def patch_dsv32_attention(source: Source) -> None:
    attention = source.find("DeepseekV32Attention")
    place = "DeepseekV32Attention.topk_indices_buffer"
    defined = [n.name for n in attention.body if isinstance(n, ast.FunctionDef)]
    if "topk_indices_buffer" in defined:
        raise source.refuse(place, "already a property: the tree carries the fix")
    init = source.find("DeepseekV32Attention.__init__")
    assigns = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        and any(ast.unparse(t) == "self.topk_indices_buffer" for t in n.targets)
    ]
    if len(assigns) != 1:
        raise source.refuse(place, f"__init__ assigns it {len(assigns)} times, expected 1")
    indent = indent_of(source, init)
    source.insert(source.offset(init.lineno, 0), leader_buffer_property(indent))


def leader_buffer_property(indent: str) -> str:
    """The plugin's class property, as methods of the attention class."""
    module, getter, setter = LEADER_BUFFER
    plugin = module_source(module)
    get_fn, set_fn = plugin.find(getter), plugin.find(setter)
    params = [a.arg for a in set_fn.args.args]
    if [a.arg for a in get_fn.args.args] != ["self"] or len(params) != 2:
        raise plugin.refuse(f"{getter}, {setter}", "are not a (self) getter and (self, x) setter")

    def body(fn: ast.FunctionDef) -> str:
        first = fn.body.index(body_start(plugin, fn))
        return "".join(reindented(plugin, n, indent + "    ") for n in fn.body[first:])

    return (
        f"{indent}@property\n"
        f"{indent}def topk_indices_buffer(self) -> torch.Tensor | None:\n"
        f'{indent}    """The impl\'s buffer: the leader\'s writers fill what followers read."""\n'
        f"{body(get_fn)}\n"
        f"{indent}@topk_indices_buffer.setter\n"
        f"{indent}def topk_indices_buffer(self, {params[1]}: torch.Tensor | None) -> None:\n"
        f"{body(set_fn)}\n"
    )


def patch_dsv32_model(source: Source) -> None:
    init = source.find("DeepseekV32Model.__init__")
    place = "DeepseekV32Model.__init__: SparseMLAIndexGroupBuilder(...)"
    calls = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "SparseMLAIndexGroupBuilder"
    ]
    if len(calls) != 1:
        raise source.refuse(place, f"{len(calls)} calls, expected 1")
    call = calls[0]
    if any(k.arg == "num_ubatches" for k in call.keywords):
        raise source.refuse(place, "already passes num_ubatches: the tree carries the fix")
    if "vllm_config" not in [a.arg for a in init.args.args + init.args.kwonlyargs]:
        raise source.refuse(place, "__init__ takes no vllm_config")
    last = (call.args + call.keywords)[-1]
    after = source.end(last)
    trailing_comma = source.text[after : after + 1] == ","
    keyword = "num_ubatches=get_num_ubatches(vllm_config.parallel_config)"
    if last.lineno == call.lineno:
        source.insert(after, f", {keyword}")
    else:
        at = after + 1 if trailing_comma else after
        comma = "" if trailing_comma else ","
        source.insert(at, f"{comma}\n{indent_of(source, last)}{keyword},")
    add_imports(source, ["from vllm.v1.worker.ubatch_utils import get_num_ubatches"])


EDITS: dict[str, Callable[[Source], None]] = {
    INDEX_GROUP: patch_index_group,
    SPARSE_MLA: patch_sparse_mla,
    DSV32_ATTENTION: patch_dsv32_attention,
    DSV32_MODEL: patch_dsv32_model,
}


def new_test_text() -> str:
    return (resources.files(__package__) / "test_sparse_mla_dbo_ubatch.py").read_text()


def read_source(file: Path, path: str) -> Source:
    """`file` parsed, or a refusal: a tree may hold anything, even where vLLM's code should be."""
    try:
        return Source(path, file.read_bytes().decode("utf-8"))
    except OSError as e:
        raise PatchRefused(path, "file", f"cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise PatchRefused(path, f"byte {e.start}", f"not UTF-8 text ({e.reason})") from None
    except SyntaxError as e:
        raise PatchRefused(path, f"line {e.lineno}", f"not valid Python: {e.msg}") from None
    except ValueError as e:  # a null byte
        raise PatchRefused(path, "file", f"not valid Python: {e}") from None


def plan(root: Path) -> dict[str, tuple[str, str]]:
    """Each file the fix touches under `root`: (its text, the patched text).

    Raises PatchRefused, naming the place, when a place is missing or changed.
    """
    if not (root / "vllm").is_dir():
        raise PatchRefused(str(root), "vllm/", "no vLLM source tree here (give its root)")
    changes = {}
    for path, edit in EDITS.items():
        file = root / path
        if not file.is_file():
            raise PatchRefused(path, "file", "missing in this tree")
        source = read_source(file, path)
        edit(source)
        patched = source.patched()
        try:
            ast.parse(patched)
        except SyntaxError as e:
            why = f"the edit does not parse: {e.msg}"
            raise PatchRefused(path, f"line {e.lineno}", why) from None
        changes[path] = (source.text, patched)
    if (root / NEW_TEST).exists():
        raise PatchRefused(NEW_TEST, "file", "already exists: the tree carries the fix")
    if not (root / NEW_TEST).parent.is_dir():
        raise PatchRefused(NEW_TEST, "tests/v1/attention/", "missing in this tree")
    changes[NEW_TEST] = ("", new_test_text())
    return changes


def unified_diff(changes: dict[str, tuple[str, str]]) -> Iterator[str]:
    """`git diff`-style text of `changes`."""
    for path, (old, new) in changes.items():
        yield f"diff --git a/{path} b/{path}\n"
        if not old:
            yield "new file mode 100644\n"
        lines = difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            "/dev/null" if not old else f"a/{path}",
            f"b/{path}",
        )
        yield from lines


def write(root: Path, changes: dict[str, tuple[str, str]]) -> None:
    """Write every file, or none: all go to temporary files first, then each replaces its own."""
    staged = []
    try:
        for path, (_, new) in changes.items():
            target = root / path
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(new)
            if target.exists():
                shutil.copymode(target, tmp)
            else:
                os.chmod(tmp, 0o644)
            staged.append((tmp, target))
    except BaseException:
        for tmp, _ in staged:
            os.unlink(tmp)
        raise
    for tmp, target in staged:
        os.replace(tmp, target)
