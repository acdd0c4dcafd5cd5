"""The package's layers, read from its source: no upward import and no import cycle.

Every ``import`` and ``from ... import`` in ``src/rlhf_fusion`` is an edge from its module to
the module it names (``from pkg import name`` goes to the submodule ``pkg.name`` where one
exists, else to ``pkg``; a ``from`` import names exactly one module, so the parents of a
dotted path add no edges). Imports inside functions count: a lazy import that breaks a cycle at
import time still ties the two modules together, so it is an edge like any other. Imports
under ``if TYPE_CHECKING:`` are type-only: they must respect the layers too, but they never run
and so do not make a cycle. ``importlib.import_module`` with a literal ``"rlhf_fusion..."``
name is an edge too, as is each entry of a package ``__init__``'s lazy ``_LAZY`` table (name ->
submodule, imported on first access).

The layers, bottom first, as the code has them (``docs/architecture.md`` draws the same): a
module may import from its own unit or from a lower layer, never from a unit beside it or above
it.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "rlhf_fusion"

LAYERS: tuple[tuple[str, ...], ...] = (
    # The root of every exception of ours, imported by every layer.
    ("rlhf_fusion.errors",),
    # Leaves. rollout/types.py: the plain data types both sides of rollout share (the
    # migration planner's errors and modes among them).
    ("rlhf_fusion.triton_kernels", "rlhf_fusion.launch", "rlhf_fusion.rollout.types"),
    ("rlhf_fusion.schedule", "rlhf_fusion.rollout.planning"),  # planning, no torch
    ("rlhf_fusion.placement",),
    ("rlhf_fusion.runtime", "rlhf_fusion.rollout"),
    ("rlhf_fusion.algorithms",),  # GRPO/RLOO advantages and losses, on runtime's masked ops
    ("rlhf_fusion.loop",),
    ("rlhf_fusion.plugins", "rlhf_fusion.integrations"),
    ("rlhf_fusion",),  # the package's __init__ alone: importing it registers the strategies
    ("rlhf_fusion.testing", "rlhf_fusion.cli"),
)

# Cycles the lead removes when the branch that opens them is merged. Each entry is the set of
# modules of one strongly connected component; the test fails on any other cycle, and on an
# entry that is no longer a cycle (so the list only shrinks).
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` is, or the innermost package of ours that holds it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _targets(module: str, is_package: bool, node: ast.AST) -> list[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            pkg = ".".join(base + ([node.module] if node.module else []))
        else:
            pkg = node.module or ""
        names = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in MODULES else pkg for a in node.names]
    elif (is_package and isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
          and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
        # A package's lazy table: attribute -> its own submodule, imported on first access.
        names = [f"{module}.{v.value.lstrip('.')}" for v in node.value.values
                 if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    elif (isinstance(node, ast.Call) and node.args
          and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
          and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        names = [node.args[0].value]
    return [t for n in names if n.split(".")[0] == PACKAGE and (t := _resolve(n))]


def _edges() -> dict[tuple[str, str], bool]:
    """``(importer, imported) -> whether every import of the pair is type-only``."""
    edges: dict[tuple[str, str], bool] = {}

    def walk(module: str, is_package: bool, node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    visit(module, is_package, stmt, True)
                for stmt in child.orelse:
                    visit(module, is_package, stmt, type_only)
            else:
                visit(module, is_package, child, type_only)

    def visit(module: str, is_package: bool, node: ast.AST, type_only: bool) -> None:
        for target in _targets(module, is_package, node):
            if target != module:
                edges[module, target] = edges.get((module, target), True) and type_only
        walk(module, is_package, node, type_only)

    for module, (path, is_package) in MODULES.items():
        walk(module, is_package, ast.parse(path.read_text(), str(path)), False)
    return edges


EDGES = _edges()


def _unit(module: str) -> str:
    """The innermost unit of ``LAYERS`` holding ``module`` (the package's own unit holds its
    ``__init__`` alone, so a new top-level module needs a place in ``LAYERS``)."""
    units = [u for layer in LAYERS for u in layer]
    return max((u for u in units
                if module == u or (u != PACKAGE and module.startswith(u + "."))), key=len)


def _layer(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _cycles() -> set[frozenset[str]]:
    """Strongly connected components (Tarjan) of more than one module, type-only edges left
    out."""
    graph: dict[str, list[str]] = defaultdict(list)
    for (a, b), type_only in EDGES.items():
        if not type_only:
            graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(MODULES)))
    try:
        for v in sorted(MODULES):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_reader_sees_the_imports_it_must():
    # A reader that missed lazy, relative or type-only imports would pass everything below.
    assert EDGES[("rlhf_fusion.loop.iteration", "rlhf_fusion.runtime.weight_sync")] is False
    assert EDGES[("rlhf_fusion.integrations.trl.migration",
                  "rlhf_fusion.rollout.rt_control")] is False  # inside a function
    assert EDGES[("rlhf_fusion.plugins.launcher", "rlhf_fusion.plugins.fused_pipeline")] is True
    assert ("rlhf_fusion.placement.hooks", "rlhf_fusion.rollout.planning") in EDGES
    assert ("rlhf_fusion.rollout", "rlhf_fusion.rollout.reference") in EDGES  # _LAZY
    assert len(MODULES) > 100 and len(EDGES) > 400


def test_every_module_has_a_layer():
    units = {u for layer in LAYERS for u in layer}
    missing = sorted(m for m in MODULES if not any(
        m == u or (u != PACKAGE and m.startswith(u + ".")) for u in units))
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_no_upward_or_sideways_import():
    bad = []
    for (a, b), type_only in sorted(EDGES.items()):
        ua, ub = _unit(a), _unit(b)
        if ua != ub and _layer(ub) >= _layer(ua):
            bad.append(f"{a} imports {b}{' (type-only)' if type_only else ''}: {ub} is not "
                       f"below {ua}")
    assert not bad, ("imports against the layers (tests/test_layering.py LAYERS, "
                     "docs/architecture.md); move the code down or the import up:\n"
                     + "\n".join(bad))


def test_no_loop_module_is_imported_by_the_mechanisms_or_the_adapters():
    # loop/ orchestrates; what it lends (R_t control, weight sync) lives in rollout/ and
    # runtime/, so the TRL and OpenRLHF adapters never depend on the loop.
    bad = sorted(f"{a} imports {b}" for a, b in EDGES
                 if b.startswith("rlhf_fusion.loop")
                 and a.startswith(("rlhf_fusion.integrations", "rlhf_fusion.rollout",
                                   "rlhf_fusion.runtime")))
    assert not bad, "\n".join(bad)


def test_no_import_cycle_outside_type_checking():
    cycles = _cycles()
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not new, ("import cycles (type-only imports under `if TYPE_CHECKING:` do not "
                     f"count; lazy imports do): {new}; move what both sides need into a "
                     "module of its own")
    assert not gone, f"no longer cycles: remove {gone} from KNOWN_CYCLES"


def _loop_cycles_with_type_checking() -> list[list[str]]:
    """Cycles among loop/ modules, type-only imports included (a cycle that holds only
    through ``TYPE_CHECKING`` is still a real dependency both ways)."""
    loop = {m for m in MODULES if m.startswith("rlhf_fusion.loop.")}
    graph: dict[str, set[str]] = {m: set() for m in loop}
    for a, b in EDGES:
        if a in loop and b in loop:
            graph[a].add(b)
    cycles = []
    for start in sorted(loop):   # a path back to itself (depth-first; loop/ is small)
        stack, seen = [(start, [start])], set()
        while stack:
            v, path = stack.pop()
            for w in sorted(graph[v]):
                if w == start:
                    cycles.append(path)
                elif w not in seen:
                    seen.add(w)
                    stack.append((w, [*path, w]))
    return cycles


def test_no_import_cycle_inside_loop_type_checking_included():
    cycles = _loop_cycles_with_type_checking()
    assert not cycles, ("import cycles among loop/ modules (TYPE_CHECKING imports count): "
                        f"{cycles[:3]}; the config is a leaf, the resolution "
                        "(loop/resolve.py) imports what it checks")


def _classes_with_layout_fields() -> list[str]:
    """Classes of src whose fields (class-level annotations) include dp, tp and pp."""
    out = []
    for module, (path, _) in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                fields = {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if {"dp", "tp", "pp"} <= fields:
                    out.append(f"{module}.{node.name}")
    return out


def test_one_layout_class():
    # (ranks, dp, tp, pp, zero) is one type; a second one means hand-written conversions.
    assert set(_classes_with_layout_fields()) == {"rlhf_fusion.placement.layout.Layout"}


# What a branch on the training layout's kind looks like in the worker: comparing a kind,
# testing an engine's class, or asking the placement or the worker which layout trains.
_KIND_BRANCH_NAMES = {"fused_training", "training_kind", "training_kinds", "_sharded",
                      "TENSOR_PARALLEL", "ZERO3", "FUSED_PIPELINE", "DATA_PARALLEL"}


def _kind_branches(source: str) -> list[str]:
    """Where ``source`` branches on a training layout's kind: any use of ``.kind`` (the
    engine is picked from it in one place: ``engine_for`` or the ``ENGINES`` table, outside
    the worker), any ``isinstance`` against an engine class, any name or attribute in
    :data:`_KIND_BRANCH_NAMES`, the worker's own ``self.fused``."""
    from rlhf_fusion.runtime.training_engine import ENGINES

    engines = {cls.__name__ for cls in ENGINES.values()} | {"TrainingEngine"}
    bad = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr in _KIND_BRANCH_NAMES:
            bad.append(f"line {line}: .{node.attr}")
        elif (isinstance(node, ast.Attribute) and node.attr == "fused"
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            bad.append(f"line {line}: self.fused")   # (inter-stage fusion's flag is not it)
        elif isinstance(node, ast.Name) and node.id in _KIND_BRANCH_NAMES:
            bad.append(f"line {line}: {node.id}")
        elif isinstance(node, ast.Compare) and any(
                isinstance(x, ast.Attribute) and x.attr == "kind"
                for x in (node.left, *node.comparators)):
            bad.append(f"line {line}: a comparison of .kind")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
              and len(node.args) == 2 and any(
                  isinstance(n, ast.Name) and n.id in engines for n in ast.walk(node.args[1]))):
            bad.append(f"line {line}: isinstance against an engine class")
    return bad


def test_the_worker_does_not_branch_on_the_training_layout_kind():
    path = SRC / PACKAGE / "loop" / "iteration.py"
    bad = _kind_branches(path.read_text())
    assert not bad, ("loop/iteration.py branches on the training layout's kind; ask the "
                     "training engine (rlhf_fusion/runtime/training_engine.py) instead:\n"
                     + "\n".join(bad))


def test_the_kind_branch_reader_sees_branches():
    # A reader that missed these would pass the worker test above whatever the worker did.
    src = ("if self.placement.fused_training: pass\n"
           "if lay.kind == 'zero3': pass\n"
           "if isinstance(self.engine, FusedPipelineEngine): pass\n"
           "if self.fused is None: pass\n"
           "if self._sharded(role): pass\n")
    assert len(_kind_branches(src)) == 5
