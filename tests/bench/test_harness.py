"""The benchmarks as a package (issue 36): every one listed by ``python -m scripts`` with a CI-sized
run or the reason it has none, pages through one harness (header, write), only memtrain's public API,
and no ``sys.path`` edits but the two that say why."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import __main__ as entry
from scripts import harness

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
BENCH = SCRIPTS / "bench"
# Where a module under scripts/ may edit sys.path, and why.
SYS_PATH_EDITS = {
    "probes/fsdp.py": "its workers are spawned processes that import it by its package name",
    "bench/accuracy/generation_processors.py": "it trains the tests' tiny model (tests/plain_trainer.py)",
    "bench/gpu/unsloth.py": "run as a file, its own folder would make `import unsloth` find the script",
}
# Benchmarks that write their page themselves, and why.
OWN_WRITERS = {
    "gpu/gpu.py": "its rows run in child processes started from its file on the device",
    "gpu/unsloth.py": "its Unsloth child runs with nothing of this repository on the path",
}


def _modules() -> list[Path]:
    return sorted(p for p in BENCH.glob("*/*.py") if p.name != "__init__.py")


def test_every_benchmark_is_listed_with_a_quick_run_or_a_reason() -> None:
    listed = entry.benchmarks()
    files = [p.relative_to(BENCH).with_suffix("").as_posix().replace("/", ".") for p in _modules()]
    assert sorted(b.module for b in listed.values()) == sorted(f"scripts.bench.{f}" for f in files)
    assert len(listed) >= 25 and {b.group for b in listed.values()} == {
        "accuracy", "techniques", "planner", "recipes", "gpu"}
    for bench in listed.values():
        assert bench.summary and "\n" not in bench.summary, bench.name
        text = (BENCH / bench.group / f"{bench.name}.py").read_text(encoding="utf-8")
        assert "\nQUICK = " in text or "\nQUICK: " in text, f"{bench.name}: no module-level QUICK"
        if bench.quick is None:
            assert isinstance(bench.quick_why, str) and len(bench.quick_why) > 20, bench.name
        else:
            assert isinstance(bench.quick, list) and all(isinstance(a, str) for a in bench.quick), bench.name


def test_a_benchmark_without_quick_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "group").mkdir()
    (tmp_path / "group" / "new.py").write_text('"""A new benchmark. More."""\nX = 1\n', encoding="utf-8")
    monkeypatch.setattr(entry, "BENCH", tmp_path)
    bench = entry.benchmarks()["new"]
    assert bench.summary == "A new benchmark." and bench.quick is None
    assert bench.quick_why == "it defines no QUICK"
    assert "no --quick: it defines no QUICK" in entry.listing()


def test_pages_start_with_the_harness_header_and_go_through_its_writer() -> None:
    problems = []
    for path in _modules():
        name = path.relative_to(BENCH).as_posix()
        calls = {ast.unparse(n.func) for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(n, ast.Call)}
        if name in OWN_WRITERS:
            continue
        if any(c.endswith(".write_text") for c in calls):
            problems.append(f"{name} writes a file itself: use harness.write")
        if "harness.write" in calls and "harness.header" not in calls:
            problems.append(f"{name} writes a page without harness.header")
    assert problems == []


def test_the_header_says_command_date_machine_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["scripts.bench.planner.plan_speed", "--sizes", "8", "a b"])
    lines = harness.header("Title")
    assert lines[0] == "# Title"
    text = "\n".join(lines)
    assert "Command: `python -m scripts run " in text and "--sizes 8 'a b'`" in text
    assert "Machine: " in text and " CPU cores" in text and "load average" in text
    assert f"Python {sys.version.split()[0]}" in text and "torch " in text


def test_a_quick_run_never_writes_over_a_committed_page(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    page = harness.BENCH / "planner.md"
    before = page.read_text(encoding="utf-8")
    monkeypatch.setenv(harness.QUICK_ENV, "1")
    written = harness.write("planner", ["# quick"])
    assert written != page and written.read_text(encoding="utf-8") == "# quick\n"
    monkeypatch.delenv(harness.QUICK_ENV)
    assert harness.write("planner", ["# trial"], trial=True) != page
    assert page.read_text(encoding="utf-8") == before
    assert harness.write("x", ["a", "b", ""], out=tmp_path / "x.md").read_text(encoding="utf-8") == "a\nb\n"


def test_rounds_interleave_the_runs_and_leave_the_warmup_out() -> None:
    order: list[str] = []
    times = harness.rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 2, warmup=1,
                           say=False)
    assert order == ["a", "b"] * 3 and {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}
    assert harness.median([3.0, 1.0, 2.0]) == 2.0 and harness.times(3.0, 2.0) == "1.50x"
    assert harness.ratio(0.0, 0.0) == 1.0 and harness.ratio(1.0, 0.0) == float("inf")


def _memtrain_private(source: str) -> list[str]:
    """memtrain names a script takes that are not public: ``_x`` names or ``_x`` modules on the path."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "memtrain":
            parts = (node.module or "").split(".")
            found += [f"{node.module}" for p in parts if p.startswith("_")]
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "memtrain"
                      and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in {"memtrain", "search", "length", "planner", "space",
                                                          "patches", "costmodel", "estimate", "trace"}:
                found.append(ast.unparse(node))
    return found


def test_scripts_use_only_memtrains_public_api() -> None:
    found = {p.relative_to(SCRIPTS).as_posix(): used for p in sorted(SCRIPTS.rglob("*.py"))
             if (used := _memtrain_private(p.read_text(encoding="utf-8")))}
    assert found == {}, found
    planted = "from memtrain.plan.search import _Search\nimport memtrain.patches._targets\nsearch._TRACES\n"
    assert _memtrain_private(planted) == ["memtrain.plan.search._Search", "memtrain.patches._targets",
                                          "search._TRACES"]


def test_no_sys_path_edits_but_the_known() -> None:
    edits = {p.relative_to(SCRIPTS).as_posix() for p in SCRIPTS.rglob("*.py")
             if "sys.path" in p.read_text(encoding="utf-8").replace("# sys.path", "")}
    assert edits == set(SYS_PATH_EDITS)


def test_the_entry_point_runs_a_benchmark_quick() -> None:
    """``python -m scripts run gpu --quick`` renders the GPU page from the committed H200 results
    (no GPU) into the temporary folder: the listing, the lookup and ``runpy`` end to end."""
    out = subprocess.run([sys.executable, "-m", "scripts", "run", "gpu", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wrote /tmp/memtrain-bench/gpu.md" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "scripts", "run", "nonesuch"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "no benchmark 'nonesuch'; one of:" in missing.stderr
    listed = subprocess.run([sys.executable, "-m", "scripts"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0 and "planner:" in listed.stdout and "plan_speed" in listed.stdout
