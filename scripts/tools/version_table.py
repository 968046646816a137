"""Run memtrain's tests on each end of its declared version range and write docs/bench/versions.md.

    python -m scripts.tools.version_table                  # the pinned set, floor and newest legs
    python -m scripts.tools.version_table --legs newest    # one leg (the others keep their rows)

Each leg is ``scripts/version_leg.sh LEG`` (its own venv, ``.venv-LEG``, pinned by
``scripts/versions/LEG.txt``); the pinned set is ``.venv`` (``scripts/setup.sh dev``) on the same
subset. A row records the versions the leg's venv holds, pytest's closing line and the wall time.
CI runs the floor leg itself (``.ci/run``); the newest leg needs a 3 GB CUDA build of torch that
CI does not fetch, so this table is how it is checked: rerun it whenever the range changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import time
from pathlib import Path

from scripts import harness

ROOT = harness.ROOT
OUT = ROOT / "docs" / "bench" / "versions.md"
RAW = ROOT / "docs" / "bench" / "versions.json"
LEGS = ("pinned", "floor", "newest")
SUMMARY = re.compile(r"^=+ (.*(passed|failed|error).*) in ([\d.]+)s.*=+$")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def run_leg(leg: str) -> dict[str, str | float]:
    """Run one leg's subset and return its versions, pytest's closing line and the wall time."""
    cmd = ["bash", "scripts/version_leg.sh", leg]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = proc.stdout.splitlines()
    versions = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("leg versions:")), "?")
    closing = next((m.group(1) for ln in reversed(lines) if (m := SUMMARY.match(ln.strip()))),
                   f"no pytest summary (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return {"leg": leg, "versions": versions, "result": closing, "exit": proc.returncode,
            "seconds": round(seconds, 1), "failed": failed[:20]}


def render(rows: list[dict]) -> str:
    head = ["# memtrain on both ends of its version range", "",
            f"`python -m scripts.tools.version_table` on {datetime.date.today()}, {_cpu_name()} "
            "(2 cores, CPU only). Each leg installs its pinned versions into a venv of its own "
            "(`scripts/version_leg.sh LEG`, pins in `scripts/versions/`) and runs the subset of the "
            "suite that covers every layer touching the libraries: the compat shims, estimator, meter, "
            "patches, trainer, plugin and TRL, DPO end to end, one `memtrain train` end to end, the "
            "exit codes. CI runs the pinned set (the whole suite) and the floor leg (`.ci/run`).", "",
            "| leg | versions | result | exit | wall |", "|---|---|---|---:|---:|"]
    body = [f"| {r['leg']} | {r['versions']} | {r['result']} | {r['exit']} | {r['seconds']:.0f} s |"
            for r in rows]
    notes = [f"- {r['leg']}: {f}" for r in rows for f in r["failed"]]
    return "\n".join([*head, *body, "", *(["Failures:", "", *notes, ""] if notes else [])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--legs", nargs="+", choices=LEGS, default=list(LEGS))
    args = parser.parse_args()
    old = {r["leg"]: r for r in json.loads(RAW.read_text())} if RAW.exists() else {}
    for leg in args.legs:
        print(f"running the {leg} leg ...", flush=True)
        old[leg] = run_leg(leg)
        print(old[leg], flush=True)
    rows = [old[leg] for leg in LEGS if leg in old]
    RAW.write_text(json.dumps(rows, indent=1) + "\n")
    OUT.write_text(render(rows))
    print(OUT.read_text())
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
