"""List and run memtrain's benchmarks: ``python -m scripts [list | run NAME [--quick] [ARGS...]]``.

A benchmark is a module ``scripts/bench/<group>/<name>.py``; its docstring's first line says what it
measures, and its module-level ``QUICK`` names the arguments of its CI-sized run (``None``: it has
none, and ``QUICK_WHY`` says why). Listing reads the files (nothing is imported); ``run`` executes
the module as ``__main__`` with ``ARGS`` (``--quick`` puts ``QUICK`` first and sets
``MEMTRAIN_BENCH_QUICK=1``, under which :func:`scripts.harness.write` writes to a temporary folder,
never over a committed page).
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.harness import QUICK_ENV

BENCH = Path(__file__).resolve().parent / "bench"


@dataclass(frozen=True)
class Benchmark:
    name: str
    group: str
    module: str
    summary: str
    quick: list[str] | None
    quick_why: str | None


def _literal(tree: ast.Module, name: str) -> object:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)  # type: ignore[arg-type]
    raise KeyError(name)


def _summary(doc: str, width: int = 96) -> str:
    """A docstring's first sentence on one line, cut to ``width``."""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    if ". " in text:
        text = text.split(". ", 1)[0] + "."
    return text if len(text) <= width else text[:width - 3].rstrip() + "..."


def benchmarks() -> dict[str, Benchmark]:
    """Every benchmark by name, read from its file."""
    found: dict[str, Benchmark] = {}
    for path in sorted(BENCH.glob("*/*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree) or ""
        try:
            quick = _literal(tree, "QUICK")
        except KeyError:  # tests/bench/test_harness.py requires one of each benchmark
            quick = None
        try:
            why = _literal(tree, "QUICK_WHY")
        except KeyError:
            why = None if "QUICK" in path.read_text(encoding="utf-8") else "it defines no QUICK"
        name = path.stem
        if name in found:
            raise SystemExit(f"two benchmarks are called {name!r}: {found[name].module} and {path}")
        found[name] = Benchmark(name, path.parent.name, f"scripts.bench.{path.parent.name}.{name}",
                                _summary(doc), quick, why)  # type: ignore[arg-type]
    return found


def listing() -> str:
    lines = []
    by_group: dict[str, list[Benchmark]] = {}
    for bench in benchmarks().values():
        by_group.setdefault(bench.group, []).append(bench)
    for group, items in by_group.items():
        lines.append(f"{group}:")
        for bench in items:
            quick = "" if bench.quick is not None else "  (no --quick: " + (bench.quick_why or "?") + ")"
            lines.append(f"  {bench.name:24} {bench.summary}{quick}")
    lines.append("\nrun one: python -m scripts run NAME [--quick] [ARGS...]  (NAME --help for its arguments)")
    return "\n".join(lines)


def run(name: str, args: list[str]) -> None:
    known = benchmarks()
    if name not in known:
        raise SystemExit(f"no benchmark {name!r}; one of: {', '.join(sorted(known))}")
    bench = known[name]
    if "--quick" in args and bench.quick is not None:
        args = [a for a in args if a != "--quick"]
        args = [*bench.quick, *args]
        os.environ[QUICK_ENV] = "1"
    elif "--quick" in args and bench.quick is None:
        raise SystemExit(f"{name} has no quick run: {bench.quick_why}")
    sys.argv = [bench.module, *args]
    runpy.run_module(bench.module, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in {"list", "-h", "--help"}:
        print(__doc__.split("\n\n", 1)[0] if argv[:1] in (["-h"], ["--help"]) else listing())
        return
    if argv[0] != "run" or len(argv) < 2:
        raise SystemExit("usage: python -m scripts [list | run NAME [--quick] [ARGS...]]")
    run(argv[1], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
