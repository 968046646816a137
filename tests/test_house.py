"""House rules that keep the package navigable: no module takes another module's ``_private`` names
(issue 36, replacing a 400-line cap that drove splits made only to stay under it), no import cycles
(issue 17, point 5), and packages that import only packages before them in the order a run goes
through them (issue 29; docs/architecture.md draws the map)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "memtrain"
# `_private` names taken across modules when the rule came (issue 36), without line numbers. One may
# only leave this list (make the name public where it is shared, or move the code to where it
# lives); a new one fails the test.
KNOWN_PRIVATE_IMPORTS: set[str] = set()  # empty: every one is fixed
# Cycles that exist and are not removed yet, each as its sorted modules. Empty: there are none.
# A cycle may only leave this list; a new one fails the test.
KNOWN_CYCLES: list[list[str]] = []
# The order a run goes through memtrain (docs/architecture.md). A module may import its own layer
# and the layers before it, never one after it. `memtrain/__init__.py` (the public face, lazy)
# and `__main__` stand above them all.
LAYERS: list[tuple[str, ...]] = [
    # shared leaves; `_compat` (the only place touching libraries' private attributes) imports
    # nothing of memtrain but `errors` (tests/test_compat.py)
    ("errors", "units", "allocator", "device", "sources", "builtin_data", "lazy_setup", "_compat"),
    ("config",), ("model",), ("data",), ("memory",), ("patches",), ("distributed",), ("reliability",),
    ("trainer",), ("estimator",), ("plan",), ("run",), ("plugin",), ("cli",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The memtrain module that importing ``name`` runs (a name inside a module is that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> memtrain modules it imports, at module level or inside functions (every
    ``import`` statement in the file; the parent packages Python imports on the way are not edges)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(_resolve(a.name, modules) for a in node.names if a.name.startswith("memtrain"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from this module's package, `level - 1` packages up
                    base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [node.module])])
                if base == "memtrain" or base.startswith("memtrain."):
                    for alias in node.names:  # `from memtrain import planner` imports a module
                        sub = f"{base}.{alias.name}"
                        edges.add(sub if sub in modules else _resolve(base, modules))
        graph[name] = {e for e in edges if e is not None and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(name: str, source: str) -> list[str]:
    """Where module ``name`` takes a ``_private`` name of another memtrain module: ``from memtrain.x
    import _y`` (relative imports too), or ``x._y`` on a memtrain module it imported (``import
    memtrain.x as x``, ``from memtrain import x``). Private *modules* (``patches/_targets.py``) are
    their package's to import; ``memtrain._compat`` holds the private attributes of libraries."""
    package = name.split(".")[:-1]
    found: list[str] = []
    modules: set[str] = set()  # local names bound to a memtrain module (or package)
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names
                           if a.name.startswith("memtrain"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [node.module])])
            if base == "memtrain" or base.startswith("memtrain."):
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{name}:{node.lineno}: from {base} import {alias.name}")
                    else:
                        modules.add(alias.asname or alias.name)  # a module, or a name: both read below
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):  # memtrain.plan.search._TRACES
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    found = [f for name, path in _modules().items()
             for f in private_imports(name, path.read_text(encoding="utf-8"))]
    new = [f for f in found if re.sub(r":\d+:", ":", f) not in KNOWN_PRIVATE_IMPORTS]
    gone = KNOWN_PRIVATE_IMPORTS - {re.sub(r":\d+:", ":", f) for f in found}
    assert not gone, f"fixed: remove these from KNOWN_PRIVATE_IMPORTS: {sorted(gone)}"
    assert not new, ("a `_private` name is its module's own: make it public where it is shared, or move "
                       f"the code that needs it to where it lives: {new}")


def test_the_private_import_check_sees_both_forms() -> None:
    source = ("from memtrain.plan.search import _Search, Candidate\nfrom . import trace\n"
              "import memtrain.memory.meter as meter\nfrom memtrain import patches\n"
              "x = meter._Tracker\ny = trace._quiet\nz = patches.__name__\nclass A:\n    _own = 1\n"
              "w = A()._own\nfrom memtrain.patches._targets import layers\nimport memtrain.plan.search\n"
              "v = memtrain.plan.search._TRACES\n")
    assert private_imports("memtrain.estimator.fake", source) == [
        "memtrain.estimator.fake:1: from memtrain.plan.search import _Search",
        "memtrain.estimator.fake:5: meter._Tracker", "memtrain.estimator.fake:6: trace._quiet",
        "memtrain.estimator.fake:13: memtrain.plan.search._TRACES"]


def test_import_graph_has_no_new_cycles() -> None:
    found = cycles(import_graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, f"import cycles (module-level or function-level imports): {new}"


def test_the_cycle_finder_finds_function_level_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    real = import_graph()
    assert "memtrain.plan.planner" in real["memtrain.cli.estimate"]  # an import inside a function counts
    assert "memtrain.config.schema" in real["memtrain.config"]


def test_the_command_line_starts_without_heavy_libraries() -> None:
    """`memtrain --help` and `memtrain validate` import no torch, transformers, datasets or peft."""
    code = ("import sys; import memtrain.cli.app; import memtrain.config; "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'peft') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _layer(module: str) -> int | None:
    """The index in LAYERS of ``memtrain.<name>...`` (None for the package itself and __main__)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return None
    return next(i for i, names in enumerate(LAYERS) if parts[1] in names)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a later layer (module-level or inside functions), as 'a -> b' lines."""
    out = []
    for module, imported in sorted(graph.items()):
        here = _layer(module)
        for other in sorted(imported):
            there = _layer(other)
            if here is not None and (there is None or there > here):
                out.append(f"{module} ({LAYERS[here][0]}) -> {other}")
    return out


def test_every_module_belongs_to_a_layer() -> None:
    stray = [m for m in import_graph() if len(m.split(".")) > 1 and m.split(".")[1] != "__main__"
             and not any(m.split(".")[1] in names for names in LAYERS)]
    assert not stray, f"add these to a layer in LAYERS and docs/architecture.md: {stray}"


def test_no_package_imports_a_package_after_it_in_the_run_order() -> None:
    found = upward_imports(import_graph())
    assert not found, ("imports against the run order (docs/architecture.md): move the code to the "
                       f"layer that needs it, or what it needs to an earlier layer: {found}")


def test_the_layer_check_sees_an_upward_import() -> None:
    graph = {"memtrain.patches.x": {"memtrain.trainer.step"}, "memtrain.trainer.step": {"memtrain.patches"},
             "memtrain.errors": {"memtrain"}}
    assert upward_imports(graph) == ["memtrain.errors (errors) -> memtrain",
                                     "memtrain.patches.x (patches) -> memtrain.trainer.step"]
