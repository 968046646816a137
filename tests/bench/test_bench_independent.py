"""Benchmarks measure memtrain against something that is not memtrain (issue 15).

A benchmark whose "measured" column came from memtrain's own meter compared the estimator with
itself: a counting mistake both share would never show. The measured side of every
``scripts/bench_*.py`` is ``scripts/memprobe.py`` (or CUDA's allocator statistics), so these
tests keep memtrain's meter out of the benchmarks and memtrain out of the probe.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from scripts.memprobe import probe_step, storage_bytes

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# memtrain's meter and the functions that run a step under it.
METER_NAMES = {"MemoryMeter", "measure_step", "measure_recipe_step"}
METER_MODULE = "memtrain.memory.meter"


def _uses(path: Path) -> set[str]:
    """The meter names and modules ``path`` imports or refers to (code only, not prose)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(METER_MODULE)}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.startswith(METER_MODULE):
                found.add(module)
            if module == "memtrain.memory":
                found |= {f"memtrain.memory.{a.name}" for a in node.names if a.name == "meter"}
            found |= {a.name for a in node.names if a.name in METER_NAMES}
        elif isinstance(node, ast.Name) and node.id in METER_NAMES:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in METER_NAMES:
            found.add(node.attr)
    return found


# Benchmarks whose subject is the meter itself (they time it; they measure no memory with it).
METER_IS_THE_SUBJECT = {"bench_meter_cost.py"}


def test_no_benchmark_measures_with_memtrains_meter() -> None:
    benches = sorted(p for p in SCRIPTS.glob("bench_*.py") if p.name not in METER_IS_THE_SUBJECT)
    assert len(benches) >= 10  # the glob found the benchmarks
    offenders = {path.name: sorted(used) for path in benches if (used := _uses(path))}
    assert offenders == {}, (
        f"benchmarks measure with memtrain's own meter: {offenders}. Fix: measure with "
        "scripts/memprobe.py (probe_step, LiveBytes) or the CUDA allocator's statistics.")


def test_the_check_sees_the_meter(tmp_path: Path) -> None:
    bench = tmp_path / "bench_x.py"
    bench.write_text("from memtrain.estimator.real_step import measure_recipe_step\n"
                     "import memtrain.memory.meter as m\nm.MemoryMeter\n", encoding="utf-8")
    assert _uses(bench) == {"measure_recipe_step", "memtrain.memory.meter", "MemoryMeter"}
    prose = tmp_path / "bench_y.py"
    prose.write_text('"""Not measured by MemoryMeter."""\nfrom memprobe import probe_step\n',
                     encoding="utf-8")
    assert _uses(prose) == set()


def test_the_probe_imports_nothing_from_memtrain() -> None:
    tree = ast.parse((SCRIPTS / "memprobe.py").read_text(encoding="utf-8"))
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
