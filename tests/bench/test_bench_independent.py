"""Benchmarks measure memtrain against something that is not memtrain (issue 15).

A benchmark whose "measured" column came from memtrain's own meter compared the estimator with
itself: a counting mistake both share would never show. The measured side of every
``scripts/bench/*/*.py`` is ``scripts/probes/memprobe.py`` (or CUDA's allocator statistics), so these
tests keep memtrain's counters (every public name of the meter, its trackers and the estimator's
event recorder, and memtrain's functions that run a step under the meter) and its offload ledgers
(the books of host bytes in ``activation_offload`` and ``optimizer_offload``) out of the
benchmarks, the probes and the independent end-to-end test, and memtrain out of the probe. The
names are derived from those modules' source, not listed here. The benchmarks that judge whether a
choice fits a budget (planner, auto-fit) count their real runs with memprobe, write their budgets
as literals, and take no verdict from memtrain's simulated budget (issue 26).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from scripts.probes.memprobe import LiveBytes, host_resident, probe_step, resident, storage_bytes

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
BENCH = SCRIPTS / "bench"  # one module per benchmark: bench/<group>/<name>.py
MEMTRAIN = ROOT / "memtrain"
# Where memtrain counts memory: every public name of these modules is a counter.
COUNTER_MODULES = ("memtrain.memory.meter", "memtrain.memory.trackers", "memtrain.estimator.trace_events")
# Where memtrain's offload code keeps its own books of host bytes.
LEDGER_MODULES = ("memtrain.patches.activation_offload", "memtrain.trainer.optimizer_offload")


def _tree(module: str) -> ast.Module:
    return ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))


def _public_names(module: str) -> set[str]:
    """What ``module`` exports: its ``__all__``, else every public name it defines at top level."""
    tree = _tree(module)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return set(ast.literal_eval(node.value))  # type: ignore[arg-type]
    return {n for n in names if not n.startswith("_")}


def _ledger_names(module: str) -> tuple[set[str], set[str]]:
    """(names, methods) of an offload module's books of host bytes: its ``*Ledger`` classes, the
    functions that hand one out (return annotation), and every function or method that reads host
    bytes (``host_*``). Methods are looked for on any object (``optimizer.host_bytes()``)."""
    names, methods = set(), set()
    for node in _tree(module).body:
        if isinstance(node, ast.ClassDef):
            if node.name.endswith("Ledger"):
                names.add(node.name)
            methods |= {f.name for f in node.body if isinstance(f, ast.FunctionDef)
                        and f.name.startswith("host_")}
        elif isinstance(node, ast.FunctionDef):
            returns = ast.unparse(node.returns) if node.returns is not None else ""
            if node.name.startswith("host_") or "Ledger" in returns:
                names.add(node.name)
    return names | methods, methods


def _runners(counters: set[str]) -> set[str]:
    """memtrain's public functions and classes that run a step under a counter: they construct one of
    the counter modules' context managers (``MemoryMeter``): ``measure_step``, ..."""
    managers = set()
    for module in COUNTER_MODULES:
        for node in _tree(module).body:
            if isinstance(node, ast.ClassDef) and node.name in counters and any(
                    isinstance(f, ast.FunctionDef) and f.name == "__enter__" for f in ast.walk(node)):
                managers.add(node.name)
    found = set()
    for path in MEMTRAIN.rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                calls = [c.func for c in ast.walk(node) if isinstance(c, ast.Call)]
                if any(getattr(f, "id", getattr(f, "attr", None)) in managers for f in calls):
                    found.add(node.name)
    return found - counters


COUNTERS = set().union(*(_public_names(m) for m in COUNTER_MODULES))
LEDGERS, LEDGER_METHODS = (set().union(*parts) for parts in zip(*(_ledger_names(m) for m in LEDGER_MODULES),
                                                               strict=True))
WATCHED = COUNTERS | LEDGERS | _runners(COUNTERS)


def _uses(path: Path) -> set[str]:
    """The counter modules and the counter, ledger and runner names ``path``'s code uses (not its
    prose): an import of a counter module; a watched name imported from memtrain, or read from a
    memtrain module (``offload.host_ledger``, ``memtrain.memory.meter.MemoryMeter``); a ledger
    method on any object (``optimizer.host_bytes()``)."""
    found: set[str] = set()
    modules: set[str] = set()  # local names bound to memtrain modules
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "memtrain":
                    modules.add(alias.asname or "memtrain")
                    found |= {m for m in COUNTER_MODULES if alias.name.startswith(m)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "memtrain":
            module = node.module or ""
            found |= {m for m in COUNTER_MODULES if module.startswith(m)}
            for alias in node.names:
                full = f"{module}.{alias.name}"
                found |= {m for m in COUNTER_MODULES if full == m}
                if alias.name in WATCHED:
                    found.add(alias.name)
                if (MEMTRAIN.parent / (full.replace(".", "/") + ".py")).exists() or \
                        (MEMTRAIN.parent / full.replace(".", "/")).is_dir():
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if node.attr in LEDGER_METHODS or (
                    node.attr in WATCHED and isinstance(root, ast.Name) and root.id in modules):
                found.add(node.attr)
    return found


# Benchmarks that may call memtrain's counters, with the reason: none of them measures with one.
METER_IS_THE_SUBJECT = {
    "techniques/meter_cost.py": "the meter is its subject: it times the meter, it measures no memory with it",
    "accuracy/allocator_replay.py": "memtrain's trace is its predicted side; the measured side is the H200 "
                                    "run's reserved bytes (docs/bench/gpu_h200.json)",
}
# The measured side itself: the probes and the test that judges the estimate with them.
PROBES = [*sorted((SCRIPTS / "probes").glob("*.py")), SCRIPTS / "harness.py",
          ROOT / "tests" / "end_to_end" / "test_independent_count.py"]


def _name(path: Path) -> str:
    """A benchmark's path under scripts/bench/ (``planner/planner.py``), a probe's under the root."""
    return path.relative_to(BENCH if path.is_relative_to(BENCH) else ROOT).as_posix()


def test_the_watched_names_come_from_the_modules() -> None:
    """The lists are derived, so a counter or ledger added later is watched too; these are a few
    that must be among them (a derivation that found nothing would watch nothing)."""
    assert {"MemoryMeter", "StepMemory", "mark_host"} <= COUNTERS  # meter
    assert {"CATEGORIES", "CATEGORY_NAMES"} <= COUNTERS  # trackers, trace_events
    assert {"HostLedger", "host_ledger", "host_bytes", "host_tensors", "host_bytes_needed"} <= LEDGERS
    assert {"host_bytes", "host_tensors"} <= LEDGER_METHODS
    assert {"measure_step", "measure_recipe_step", "MemoryMeterCallback"} <= WATCHED
    assert not any(n.startswith("_") for n in WATCHED)


def test_no_benchmark_measures_with_memtrains_meter() -> None:
    benches = sorted(p for p in BENCH.glob("*/*.py")
                     if p.name != "__init__.py" and _name(p) not in METER_IS_THE_SUBJECT)
    assert len(benches) >= 20 and len(PROBES) >= 5  # the globs found the benchmarks and the probes
    offenders = {_name(path): sorted(used) for path in [*benches, *PROBES] if (used := _uses(path))}
    assert offenders == {}, (
        f"benchmarks measure with memtrain's own counters or ledgers: {offenders}. Fix: measure with "
        "scripts/probes/memprobe.py (probe_step, LiveBytes, resident, host_resident, trainer_steps) or the "
        "CUDA allocator's statistics.")


def test_the_check_sees_the_meter(tmp_path: Path) -> None:
    bench = tmp_path / "bench_x.py"
    bench.write_text("from memtrain.estimator.real_step import measure_recipe_step\n"
                     "import memtrain.memory.meter as m\nm.MemoryMeter\n", encoding="utf-8")
    assert _uses(bench) == {"measure_recipe_step", "memtrain.memory.meter", "MemoryMeter"}
    prose = tmp_path / "bench_y.py"
    prose.write_text('"""Not measured by MemoryMeter."""\nfrom memprobe import probe_step\n'
                     "PHASES = ('a', 'b')\nprint(PHASES, probe_step)\n", encoding="utf-8")
    assert _uses(prose) == set()  # prose, and a name of its own that a counter module also has


def test_the_check_sees_the_ledgers(tmp_path: Path) -> None:
    bench = tmp_path / "bench_x.py"
    bench.write_text("from memtrain.patches import activation_offload as offload\n"
                     "from memtrain.trainer.optimizer_offload import OffloadOptimizer\n"
                     "ledger = offload.host_ledger(model)\nopt = OffloadOptimizer(params)\n"
                     "host = opt.host_bytes()\noffload.apply(model, cfg)\n", encoding="utf-8")
    assert _uses(bench) == {"host_ledger", "host_bytes"}  # applying offload is fine; its books are not


@pytest.mark.parametrize("module", [*COUNTER_MODULES, *LEDGER_MODULES])
def test_every_watched_name_is_seen_when_imported(module: str, tmp_path: Path) -> None:
    names = sorted(_public_names(module) & WATCHED) or sorted(LEDGERS & _public_names(module))
    assert names, module
    bench = tmp_path / "bench_x.py"
    bench.write_text("".join(f"from {module} import {n}\n" for n in names), encoding="utf-8")
    counted = {module} if module in COUNTER_MODULES else set()
    assert _uses(bench) == set(names) | counted


@pytest.mark.parametrize("planted", [
    "from memtrain.memory.trackers import CATEGORY_NAMES",
    "from memtrain.estimator import trace_events",
    "import memtrain.memory.meter",
    "from memtrain.patches.activation_offload import HostLedger",
    "host = optimizer.host_tensors()",
])
def test_a_planted_import_in_a_real_benchmark_is_caught(planted: str, tmp_path: Path) -> None:
    """Every benchmark passes today; each with one planted line no longer does."""
    for name in ("techniques/tiled_mlp.py", "techniques/memory_modes.py"):
        bench = tmp_path / Path(name).name
        bench.write_text((BENCH / name).read_text(encoding="utf-8") + f"\n{planted}\n", encoding="utf-8")
        assert _uses(BENCH / name) == set()
        assert _uses(bench), (name, planted)


def test_the_probe_imports_nothing_from_memtrain() -> None:
    tree = ast.parse((SCRIPTS / "probes" / "memprobe.py").read_text(encoding="utf-8"))
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [m for m in modules if m.split(".")[0] == "memtrain"] == []


def _step_on(fake: bool) -> dict[str, int]:
    mode = FakeTensorMode() if fake else torch.no_grad()
    with mode:
        torch.manual_seed(0)
        layer = torch.nn.Linear(64, 32)
        x = torch.randn(16, 64)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def step() -> None:
        layer(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if fake:
        with mode:
            return probe_step(step, layer, optimizer, {"x": x})
    return probe_step(step, layer, optimizer, {"x": x})


def test_probe_step_counts_real_and_fake_steps_alike() -> None:
    real, fake = _step_on(fake=False), _step_on(fake=True)
    held = 4 * (64 * 32 + 32 + 16 * 64)  # weight, bias, input
    assert real["resident"] == fake["resident"] == held
    assert real["peak"] == fake["peak"] > held  # output and gradients come on top
    assert real["rss_peak"] >= real["rss_before"] > 0


def test_storage_bytes_counts_views_once() -> None:
    t = torch.zeros(10, 10)
    assert storage_bytes([t, t[0], t.view(100)]) == 400
    with FakeTensorMode():
        f = torch.zeros(10, 10)
        assert storage_bytes([f, f[1:], torch.zeros(5)]) == 420


def test_live_bytes_follows_storage_resizes() -> None:
    """``UntypedStorage.resize_`` runs below the dispatcher (FSDP2 frees and regathers weights so):
    the counter follows it, for its own storages and for ones made before it started."""
    before = torch.zeros(100)  # 400 bytes, not the counter's
    with LiveBytes() as probe:
        made = torch.zeros(50)  # 200
        made.untyped_storage().resize_(0)
        assert probe.current == 0
        made.untyped_storage().resize_(800)
        before.untyped_storage().resize_(0)  # frees the 400 it did not count: -400
        assert probe.current == 800 - 400 and probe.peak == 800
        before.untyped_storage().resize_(1000)
        assert probe.current == 800 + 600
        out = torch.empty(0)
        torch.add(torch.ones(10), 1, out=out)  # an `out=` op resizes its output: 40 more
        assert probe.current == 800 + 600 + 40  # (the ones(10) it was given is freed)
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # put back


def test_live_bytes_counts_what_pack_hooks_make_as_host() -> None:
    """Host bytes are what a saved-tensor pack hook creates (torch's ``save_on_cpu`` here, which
    with ``pin_memory`` copies even on a CPU), known from torch, not from an offload ledger; they
    die with the graph."""
    x = torch.randn(64, 64, requires_grad=True)
    with LiveBytes() as probe:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            y = (x * 2).sin().sum()
        host = probe.host_current
        y.backward()
        del y
    assert host == 64 * 64 * 4  # sin's input, moved
    assert probe.host_current == 0 and probe.host_peak == host
    assert probe.device_peak < probe.peak  # the host copy is not device memory


def test_resident_tells_an_offloading_optimizers_copies_apart() -> None:
    layer = torch.nn.Linear(16, 16)
    copies = [p.detach().clone() for p in layer.parameters()]  # what an offloading optimizer steps
    optimizer = torch.optim.SGD(copies, lr=0.1, momentum=0.9)
    for c in copies:
        c.grad = torch.ones_like(c)
    optimizer.step()
    params = 4 * (16 * 16 + 16)
    assert resident(layer, optimizer, {}) == params
    assert host_resident(layer, optimizer) == 3 * params  # copies, their gradients, momentum


# Benchmarks that judge whether a method's choice fits a budget (issue 26): the verdict is
# memprobe's count of the real run (``trainer_steps``), and the budgets are constants written in
# the script (the named assignment holds literals only: no estimate, no earlier table read in).
JUDGED = {"planner/planner.py": "CASES", "planner/autofit.py": "BUDGETS_MIB"}
# memtrain's simulated budget raises out-of-memory errors when memtrain's own tracker counts more
# than the limit: never a verdict. A benchmark may run methods in it as their environment (a CPU has
# no device limit to run out of) only where listed here, with the reason.
SIMULATED = {"SimulatedBudget", "SimulatedBudgetCallback", "simulate_budget"}
SIMULATED_ENVIRONMENT = {
    "planner/autofit.py": "HF's auto_find_batch_size and memtrain's auto-fit react to out-of-memory "
                        "errors; both run under the same simulated budget, and memprobe judges the result",
}


def _judged_problems(path: Path, constant: str, environment_ok: bool) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    problems = []
    probes = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              and (n.module or "").split(".")[-1] == "memprobe" for a in n.names}
    if "trainer_steps" not in probes:
        problems.append("does not count its runs with memprobe.trainer_steps")
    values = [n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == constant
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    if len(values) != 1:
        problems.append(f"no single module-level {constant}")
    for value in values:
        for node in ast.walk(value):
            case = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Case"
            call = isinstance(node, ast.Call) and not case
            if call or isinstance(node, (ast.Attribute, ast.Subscript, ast.BinOp)) or (
                    isinstance(node, ast.Name) and node.id != "Case"):
                problems.append(f"{constant} is not literal: {ast.unparse(node)}")
    used = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(tree)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    used |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    if not environment_ok and (hit := SIMULATED & used):
        problems.append(f"uses memtrain's simulated budget: {sorted(hit)}")
    return problems


def test_budget_benchmarks_judge_with_memprobe_on_fixed_budgets() -> None:
    problems = {name: found for name, constant in JUDGED.items()
                if (found := _judged_problems(BENCH / name, constant, name in SIMULATED_ENVIRONMENT))}
    assert problems == {}, problems


@pytest.mark.parametrize(("name", "planted", "caught"), [
    ("planner/planner.py", ('    Case("roomy", 600,', '    Case("roomy", int(estimate(cfg).total_bytes),'),
     "CASES is not literal"),
    ("planner/planner.py", ("memprobe import trainer_steps", "memprobe import probe_step"),
     "does not count its runs with memprobe"),
    ("planner/planner.py", ("import torch\n", "import torch\nfrom memtrain.reliability import budget\n"
                                            "budget.SimulatedBudget\n"), "simulated budget"),
    ("planner/autofit.py", ("BUDGETS_MIB = (100,", "BUDGETS_MIB = (PEAK // MiB,"),
     "BUDGETS_MIB is not literal"),
])
def test_a_planted_judge_or_budget_is_caught(name: str, planted: tuple[str, str], caught: str,
                                             tmp_path: Path) -> None:
    text = (BENCH / name).read_text(encoding="utf-8")
    assert planted[0] in text
    bench = tmp_path / Path(name).name
    bench.write_text(text.replace(planted[0], planted[1], 1), encoding="utf-8")
    problems = _judged_problems(bench, JUDGED[name], name in SIMULATED_ENVIRONMENT)
    assert any(caught in p for p in problems), problems
