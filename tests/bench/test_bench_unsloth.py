"""scripts/bench_unsloth.py's logic on a CPU (issue 39): the search, the phases, the JSON and the page.

The GPU run cannot happen here; its backend ``fake`` runs the same phases with a tiny Llama and a
simulated card whose out-of-memory rule is a formula (``FAKE_MEMORY``), so the longest length each
framework should find is known exactly. The frameworks run in this process (``--inline``), which
on a GPU Unsloth's patching rules out.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import bench_unsloth as bench

GiB = 2**30


@pytest.fixture(autouse=True)
def _own_profile_and_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The inline workers set one torch thread, and a plan on another thread count measures rates
    and saves them into the calibration profile: give these tests a copy of the suite's profile and
    restore the thread count, so no later test plans with rates measured here."""
    import os
    import shutil

    import torch

    from memtrain.plan import costmodel

    copy = tmp_path / "calibration.json"
    shutil.copy(os.environ["MEMTRAIN_CALIBRATION"], copy)
    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(copy))
    threads = torch.get_num_threads()
    costmodel.rates.cache_clear()
    yield
    torch.set_num_threads(threads)
    costmodel.rates.cache_clear()


def fake_longest(framework: str, cap_gib: int) -> int:
    """The longest multiple of ALIGN tokens the fake card holds, from the formula, not the search."""
    base, per_token = bench.FAKE_MEMORY[framework]
    return (cap_gib * GiB - base) // per_token // bench.ALIGN * bench.ALIGN


class Clock:
    """A clock the probes advance: the search's time limit without this machine's speed in it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("true_max", [76_458, 163_840, 5_000, 4_096, 300, 100])
def test_the_search_returns_the_longest_length_that_fits(true_max: int) -> None:
    """Doubling then bisection ends on the longest multiple of ALIGN that fits, with the next one
    failing; a card that fits nothing gives 0."""
    probed = []

    def fits(length: int) -> bool:
        probed.append(length)
        return length <= true_max

    found = bench.longest(fits, deadline=1e9, clock=Clock())
    expected = true_max // bench.ALIGN * bench.ALIGN
    assert found["longest"] == expected
    assert found["failed"] == expected + bench.ALIGN and found["cut"] is None
    assert all(n % bench.ALIGN == 0 for n in probed) and len(probed) == len(set(probed))
    assert len(probed) <= 2 * (bench.MAX_LENGTH // bench.START).bit_length() + 10  # doubling + bisection


def test_the_search_stops_at_its_limit_and_at_its_deadline() -> None:
    assert bench.longest(lambda n: True, deadline=1e9, clock=Clock())["cut"] == "limit"
    everything = bench.longest(lambda n: True, deadline=1e9, clock=Clock())
    assert everything["longest"] == bench.MAX_LENGTH and everything["failed"] is None

    clock = Clock()

    def slow(length: int) -> bool:  # each probe takes (length / 4096)**2 seconds
        clock.now += (length / 4096) ** 2
        return length <= 100_000

    # 4096 (1 s), 8192 (4 s), 16384 (16 s): the next, 32768, is predicted at 64 s, past the deadline
    found = bench.longest(slow, deadline=30.0, clock=clock)
    assert found["cut"] == "time" and found["longest"] == 16_384 and found["failed"] is None
    assert [n for n, _, _ in found["probes"]] == [4096, 8192, 16384]


def test_a_step_time_is_predicted_from_the_longest_measured() -> None:
    assert bench.predicted_seconds(8192, [(4096, 2.0), (1024, 1.0)]) == 64.0  # 1 s x 8^2 > 2 s x 2^2
    assert bench.predicted_seconds(8192, []) == 0.0
    one_b = bench.apriori_seconds(65_536, bench.MODEL)
    assert 5 < one_b < 60  # a 1B step at 64k tokens: attention 2.2e15 FLOPs, the linear layers 0.8e15


def test_memtrains_plan_is_read_from_its_json() -> None:
    printed = "note: something on stdout first\n" + json.dumps({
        "budget_bytes": 8 * GiB, "usable_bytes": int(7.2 * GiB), "planning_seconds": 12.5,
        "settings": {"data.max_length": 51_200, "memory.tiled_mlp_tile_tokens": 1024},
        "chosen": {"peak_bytes": 7 * GiB, "host_bytes": 3 * GiB},
        "max_length": {"why": "51,200 tokens fit; 51,456 do not"}})
    plan = bench.read_plan(printed)
    assert plan["length"] == 51_200 and plan["predicted_total"] == 7 * GiB
    assert plan["usable"] == int(7.2 * GiB)
    base = bench.memtrain_recipe(bench.LONG_MEMORY, "auto", 8, bench.MODEL)
    recipe = bench.with_settings(base, plan["settings"])
    assert recipe["data"]["max_length"] == 51_200 and recipe["memory"]["tiled_mlp_tile_tokens"] == 1024
    assert recipe["memory"]["budget"] == "8GiB" and recipe["adapter"]["r"] == 32
    assert recipe["memory"]["offload"] == {"activations": True, "embeddings": False}  # the head is tied


def run_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> dict:
    monkeypatch.setattr(bench, "INLINE", False)
    out = tmp_path / "unsloth.md"
    assert bench.main(["--backend", "fake", "--inline", "--budget-s", "600", "--out", str(out), *extra]) == 0
    return json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))


def test_a_fake_run_finds_each_frameworks_longest_and_renders_the_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = run_fake(tmp_path, monkeypatch)
    theirs, ours = bench.by_task(raw["baseline"]), bench.by_task(raw["memtrain"])
    assert raw["baseline"]["framework"] == "unsloth" and raw["baseline"]["fallback_why"] is None
    for cap in bench.CAPS_GIB:
        row = theirs[f"longest {cap} GiB"]
        assert row["longest"] == fake_longest("unsloth", cap) and row["cut"] is None
        assert row["at_longest"]["allocated"] == bench.SimulatedCard("unsloth").need(row["longest"])
        plan = raw["plans"][str(cap)]
        assert ours[f"longest {cap} GiB"]["fits"] and ours[f"longest {cap} GiB"]["length"] == plan["length"]
    speed = ours["speed"]
    assert speed["length"] == bench.SPEED_LENGTH and len(speed["steps_s"]) == bench.TIMED
    assert speed["tokens_per_s"] == pytest.approx(bench.SPEED_LENGTH / speed["step_s"])
    at_theirs = ours["speed at their longest"]
    assert at_theirs["length"] == fake_longest("unsloth", bench.CAPS_GIB[0]) and at_theirs["fits"]

    page = (tmp_path / "unsloth.md").read_text(encoding="utf-8")
    assert "Fake backend: not a measurement" in page
    ratio = raw["plans"]["8"]["length"] / fake_longest("unsloth", 8)
    assert f"| 8 GiB | {fake_longest('unsloth', 8):,} |" in page and f"{ratio:.2f}x" in page
    rendered = tmp_path / "again.md"
    assert bench.main(["--render", str(tmp_path / "unsloth.json"), "--out", str(rendered)]) == 0
    assert rendered.read_text(encoding="utf-8") == page


def test_without_unsloth_the_baseline_is_hf_and_the_page_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_load = bench.Worker.load

    def load(self: bench.Worker, recipe: dict | None = None) -> None:
        if self.job["framework"] == "unsloth":
            raise ImportError("No module named 'unsloth'")
        real_load(self, recipe)

    monkeypatch.setattr(bench, "CAPS_GIB", (8,))
    monkeypatch.setattr(bench.Worker, "load", load)
    raw = run_fake(tmp_path, monkeypatch)
    assert raw["baseline"]["framework"] == "hf"
    assert "ImportError: No module named 'unsloth'" in raw["baseline"]["fallback_why"]
    assert bench.by_task(raw["baseline"])["longest 8 GiB"]["longest"] == fake_longest("hf", 8)
    page = (tmp_path / "unsloth.md").read_text(encoding="utf-8")
    assert "**Unsloth did not run**, so the baseline is HF + SDPA" in page and "| HF + SDPA longest |" in page


def test_on_a_machine_without_cuda_it_stops_and_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "unsloth.md"
    assert bench.main(["--out", str(out)]) == 2 and not out.exists()
    with pytest.raises(SystemExit, match="--inline"):
        bench.main(["--inline", "--out", str(out)])


def test_the_unsloth_process_gets_its_own_site_and_no_memtrain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", f"/tmp/site:{bench.ROOT}")
    monkeypatch.setenv("BENCH_UNSLOTH_SITE", "/tmp/site-unsloth")
    theirs = bench.child_env("cuda", "unsloth")["PYTHONPATH"].split(":")
    assert theirs == ["/tmp/site-unsloth", "/tmp/site"]  # its transformers first; memtrain not importable
    ours = bench.child_env("cuda", "memtrain")
    assert ours["PYTHONPATH"].split(":")[0] == str(bench.ROOT)
    assert ours["PYTORCH_CUDA_ALLOC_CONF"] == bench.child_env("cuda", "unsloth")["PYTORCH_CUDA_ALLOC_CONF"]


def test_plans_missing_from_the_file_are_made_beside_the_baseline_and_stopped_at_the_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the device a plan the file lacks runs as `memtrain plan` in the background; one that is not
    done when memtrain's phase starts is stopped and its row says so (commands stand in here)."""
    plan = {"usable_bytes": 7, "settings": {"data.max_length": 512}, "chosen": {"peak_bytes": 6}}
    commands = {"8": [sys.executable, "-c", f"print({json.dumps(json.dumps(plan))})"],
                "16": [sys.executable, "-c", "import time; time.sleep(60)"]}
    by_card = lambda recipe, folder: commands[recipe["memory"]["budget"][:-3]]  # noqa: E731
    monkeypatch.setattr(bench, "plan_command", by_card)
    profile = tmp_path / "given" / "profile.json"
    profile.parent.mkdir()
    profile.write_text("{}", encoding="utf-8")
    jobs = bench.plan_jobs()
    background = bench.Background({"8": jobs["8"], "16": jobs["16"]}, profile, tmp_path)
    began = time.monotonic()
    got = background.collect(time.time() + 3)
    assert time.monotonic() - began < 30
    assert got["8"]["length"] == 512 and "settings" in got["8"]
    assert "not planned in time" in got["16"]["error"]
    assert all(proc.poll() is not None for proc in background.running.values())
