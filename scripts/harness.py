"""What every benchmark shares: where it writes, the header of its page, interleaved timing rounds,
medians and ratios.

A benchmark is a module under ``scripts/bench/<group>/``; ``python -m scripts`` lists them and
``python -m scripts run NAME`` runs one (``--quick`` for its CI-sized run). Its page starts with
:func:`header`, so every table in docs/bench/ says the same things the same way: the command that
wrote it, the date, the machine and the library versions. No memtrain import here: the harness is
shared by the measured side too.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
# The libraries a page names, when installed (memtrain's own version is the commit's).
QUICK_ENV = "MEMTRAIN_BENCH_QUICK"  # set by ``python -m scripts run NAME --quick``
LIBRARIES = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes")


def name_of(module: str) -> str:
    """A benchmark's name from its module: ``scripts.bench.planner.plan_speed`` -> ``plan_speed``."""
    return module.rsplit(".", 1)[-1]


def command(argv: Sequence[str] | None = None) -> str:
    """The command that reruns this benchmark as it was run: ``python -m scripts run NAME ARGS``.

    The name comes from the running ``__main__`` module (run by the entry point or with ``python -m
    scripts.bench.GROUP.NAME``); arguments from ``argv`` (default: this process's)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    module = spec.name if spec is not None else Path(getattr(main, "__file__", "bench")).stem
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m scripts run", name_of(module), *map(shlex.quote, args)])


def versions(libraries: Iterable[str] = LIBRARIES) -> str:
    """``Python 3.12.3, torch 2.13.0, transformers 5.19.0, ...``: the installed ones of ``libraries``."""
    found = [f"Python {platform.python_version()}"]
    for library in libraries:
        try:
            found.append(f"{library} {metadata.version(library)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def machine() -> str:
    """The CPU (model name, cores), and the GPU where torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} CPU cores"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    else:
        text += ", no GPU"
    return text


def load() -> str:
    """The load average (1 / 5 / 15 minutes): a shared machine's times are only comparable within a run."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f}"


def header(title: str, *, argv: Sequence[str] | None = None, libraries: Iterable[str] = LIBRARIES,
           run: str | None = None) -> list[str]:
    """The first lines of a page: its title, then the command, the date, the machine (with its load)
    and the versions. ``run`` overrides the command (a page rendered from a saved run says which)."""
    return [f"# {title}", "",
            f"Command: `{run or command(argv)}` on {datetime.date.today()}.  ",
            f"Machine: {machine()}; {load()}.  ",
            f"Versions: {versions(libraries)}.", ""]


def quick() -> bool:
    """Whether this is a CI-sized run (``python -m scripts run NAME --quick``): its page is not kept."""
    return os.environ.get(QUICK_ENV) == "1"


def write(name: str, lines: Iterable[str], out: Path | str | None = None, *, trial: bool = False) -> Path:
    """Write a page (``docs/bench/NAME.md`` unless ``out`` says elsewhere) and say where. A quick run
    (or a ``trial``: a benchmark's own reduced mode) writes to a temporary folder instead: a CI-sized
    run never replaces a committed table."""
    path = Path(out) if out is not None else BENCH / f"{name}.md"
    if (quick() or trial) and path.resolve().is_relative_to(BENCH.resolve()):
        path = Path(tempfile.gettempdir()) / "memtrain-bench" / path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return path


def rounds(runs: dict[Hashable, Callable[[], object]], count: int, warmup: int = 0,
           say: bool = True) -> dict[Hashable, list[float]]:
    """Seconds of each run per round, the runs interleaved within a round so that the machine's noise
    hits them alike; ``warmup`` untimed rounds first."""
    times: dict[Hashable, list[float]] = {key: [] for key in runs}
    for index in range(warmup + count):
        if say and index >= warmup:
            print(f"timing round {index - warmup + 1}/{count} ...", flush=True)
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            if index >= warmup:
                times[key].append(time.perf_counter() - start)
    return times


def median(values: Iterable[float]) -> float:
    """The median (raises on no values: a benchmark with nothing timed has nothing to report)."""
    return statistics.median(list(values))


def ratio(value: float, base: float) -> float:
    """``value / base``; infinity where the base is 0 and the value is not (0 / 0 is 1)."""
    if base == 0:
        return 1.0 if value == 0 else float("inf")
    return value / base


def times(value: float, base: float, digits: int = 2) -> str:
    """A ratio as a page writes it: ``1.07x``."""
    return f"{ratio(value, base):.{digits}f}x"
