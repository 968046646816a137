"""`data.max_length: auto`: the planner finds the longest length that fits, reports it, and
everything that needs a length before planning says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import causal_recipe
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import RecipeError, load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator.estimate import estimate
from memtrain.plan import length, planner

STEP = 64  # a small step keeps the tiny model's lengths (and the test) short


def _recipe(tmp_path: Path, corpus: Path, **memory: object) -> dict:
    return causal_recipe(tmp_path, corpus, data={"max_length": "auto"}, memory=memory,
                         training={"micro_batch_size": 1, "gradient_accumulation": 1})


@pytest.fixture
def step(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(length, "LENGTH_STEP", STEP)
    monkeypatch.setattr(length, "FIRST_PROBE", STEP)
    return STEP


def _total(cfg: object, tokens: int, **values: object) -> int:
    return estimate(planner.with_values(cfg, {"data.max_length": tokens, **values}), device="cpu").total_bytes


def test_the_plan_is_the_longest_length_that_fits_and_the_next_does_not(
        tmp_path: Path, tiny_text_file: Path, step: int) -> None:
    cfg = load_recipe(_recipe(tmp_path, tiny_text_file, checkpointing="full", loss="auto"))
    lean = {"memory.loss": "chunked"}
    below, above = _total(cfg, 3 * step, **lean), _total(cfg, 4 * step, **lean)
    budget = int((below + above) / 2 / 0.9)  # 3 steps fit (10% margin), 4 do not
    decided = planner.plan(cfg, budget, device="cpu")
    assert decided.settings()["data.max_length"] == 3 * step
    assert "data.max_length" in decided.auto
    assert decided.length is not None and decided.length.probes[3 * step] == below
    assert decided.length.probes[4 * step] == above
    assert len(decided.length.probes) <= 4  # a line and regula falsi, not a walk over every step
    assert decided.length.leanest["memory.loss"] == "chunked"  # probed with every technique on
    resolved = decided.apply(cfg)
    assert resolved.data.max_length == 3 * step
    assert _total(resolved, 3 * step) <= decided.usable  # the settings chosen at that length fit


def test_a_position_limit_that_fits_is_found_with_one_estimate(
        tmp_path: Path, tiny_text_file: Path, step: int) -> None:
    """Where the model's position limit lies far past the first two lengths the search would probe
    (64 and 512 here, the limit 2,048), it probes the limit first: with room to spare that one
    estimate is the answer (Llama-3.1-8B at 24 and 80 GiB: 3 estimates were 1); where the limit does
    not fit, it is the far end of the line in place of the second length, the line's answer never
    further than that length (the peak here bends: 5 estimates without the limit first, 6 with it,
    10 where a far line guided the search unbounded). Planted: `_solve` without the first probe of
    the limit -> probes {64, 512, 1024, 1088, 2048}, the first assertion fails; with it under
    `exact_length` too -> the last fails."""
    recipe = _recipe(tmp_path, tiny_text_file, checkpointing="full", loss="chunked")
    recipe["model"]["from_config"]["max_position_embeddings"] = 2048
    cfg = load_recipe(recipe)
    roomy = planner.plan(cfg, 2 * _total(cfg, 2048), device="cpu")
    assert roomy.length is not None and sorted(roomy.length.probes) == [2048], roomy.length.probes
    assert roomy.settings()["data.max_length"] == 2048
    below, above = _total(cfg, 3 * step), _total(cfg, 4 * step)
    tight = planner.plan(cfg, int((below + above) / 2 / 0.9), device="cpu")  # 3 steps fit, 4 do not
    assert tight.length is not None and tight.settings()["data.max_length"] == 3 * step
    assert 2048 in tight.length.probes
    assert len(tight.length.probes) <= 6, tight.length.probes  # without the limit first: 5
    # where every loop iteration runs, an estimate at the limit costs more than the search it could
    # save (the 8B at 8 GiB: 866 s against 71): not first there
    exact = length.longest_length(cfg, "cpu", tight.usable, exact_length=True)
    assert exact.chosen == 3 * step and 2048 not in exact.probes, exact.probes


@pytest.mark.long  # elision equals every iteration, in the suite: tests/estimator/test_loop_elision.py
def test_exact_length_runs_every_loop_iteration_of_every_trace_and_finds_the_same_length(
        tmp_path: Path, tiny_text_file: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``longest_length(..., exact_length=True)`` (scripts/bench/planner/plan_speed.py's "every iteration"
    row) reaches every trace of the search, the leanest settings' too, and answers as the elided
    search does. Planted: Search not passing it on -> the calls fail."""
    from memtrain.estimator import estimate as est

    cfg = load_recipe(_recipe(tmp_path, tiny_text_file, checkpointing="full", loss="auto", tiled_mlp=True))
    budget = int(_total(cfg, 3 * step, **{"memory.loss": "chunked"}) / 0.9)
    traced = est.trace_candidates_at
    calls: list[bool] = []

    def counted(plan: object, points: object, exact: bool, exact_length: bool = False) -> object:
        calls.append(exact_length)
        return traced(plan, points, exact, exact_length)

    monkeypatch.setattr(est, "trace_candidates_at", counted)
    usable = int(budget * 0.9)
    whole = length.longest_length(cfg, "cpu", usable, exact_length=True)
    assert calls and all(calls), calls
    calls.clear()
    elided = length.longest_length(cfg, "cpu", usable)
    assert calls and not any(calls)
    assert whole.chosen == elided.chosen and whole.probes == elided.probes


def test_a_length_the_host_cannot_hold_says_so(tmp_path: Path, tiny_text_file: Path, step: int) -> None:
    """Where the host memory bounds the length (activation offload), the plan names it: the 80 GiB
    row of docs/bench/long_context.md said "524,544 needs 72.00 GiB", the device's budget plus one
    byte, for a length whose 278 GiB of host memory was over the 256 GiB allowed."""
    cfg = load_recipe(_recipe(tmp_path, tiny_text_file, checkpointing="full",
                              offload={"activations": True, "min_tensor_bytes": 1024}))
    host = [estimate(planner.with_values(cfg, {"data.max_length": n}), device="cpu").host_peak_bytes
            for n in (3 * step, 4 * step)]
    assert 0 < host[0] < host[1]
    found = length.longest_length(cfg, "cpu", 2**40, host=(host[0] + host[1]) // 2)
    assert found.chosen == 3 * step
    assert found.host_over[4 * step] == host[1]
    assert (f"{4 * step:,} needs {length.format_bytes(host[1])} of host memory, more than the "
            f"{length.format_bytes((host[0] + host[1]) // 2)} allowed") in found.explain()
    with pytest.raises(MemtrainError, match=r"finds no length that fits: .* of host memory, more than the "
                                            r".* allowed with the leanest settings\. Fix: raise "
                                            r"`memory.budget` or `memory.host_budget`"):
        length.longest_length(cfg, "cpu", 2**40, host=1024)


def test_a_budget_that_fits_no_length_names_the_field_and_the_peak(
        tmp_path: Path, tiny_text_file: Path, step: int) -> None:
    cfg = load_recipe(_recipe(tmp_path, tiny_text_file, checkpointing="full"))
    with pytest.raises(MemtrainError, match=r"`data.max_length`: `auto` finds no length that fits: "
                                            rf"{step} tokens need .* Fix: raise `memory.budget`"):
        planner.plan(cfg, "1MiB", device="cpu")


def test_plan_json_reports_the_length_and_estimate_asks_for_a_plan(
        tmp_path: Path, tiny_text_file: Path, step: int) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path, tiny_text_file, checkpointing="full")))
    cfg = load_recipe(str(path))
    budget = int(_total(cfg, 2 * step) / 0.9) + 1
    args = ["plan", str(path), "--budget", str(budget), "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["settings"]["data.max_length"] == found["max_length"]["chosen"] >= 2 * step
    assert "data.max_length" in found["auto_fields"] and "leanest settings fit" in found["max_length"]["why"]
    shown = CliRunner().invoke(app, args)
    assert f"data.max_length={found['max_length']['chosen']}" in shown.output
    asked = CliRunner().invoke(app, ["estimate", str(path), "--device", "cpu"])
    assert asked.exit_code == 2 and "Traceback" not in asked.output
    assert "`data.max_length` is `auto`" in asked.output and "memtrain plan" in asked.output


def test_the_data_read_uncut_bounds_the_length_and_is_a_length_the_plan_may_answer(
        tmp_path: Path, tiny_text_file: Path, step: int) -> None:
    """Rows read uncut (`train`, `plan --data`) bound the search at the data's longest row: a budget
    that fits those rows but not one step of the worst case plans the data's own length (before:
    no length fits, at the shortest step); with room to spare, no length past the data is probed.
    Planted: `longest_length` without the cap -> the first plan raises."""
    from memtrain.data.prepare import read_rows

    cfg = load_recipe(_recipe(tmp_path, tiny_text_file, checkpointing="full"))
    rows = read_rows(cfg)
    assert rows.read and not rows.packed and rows.longest < step
    fits, over = _total(cfg, rows.longest), _total(cfg, step)
    budget = int((fits + over) / 2 / 0.9)
    with pytest.raises(MemtrainError, match=rf"finds no length that fits: {step} tokens need"):
        planner.plan(cfg, budget, device="cpu")  # the worst case: not even one step fits
    decided = planner.plan(cfg, budget, device="cpu", rows=rows)
    assert decided.settings()["data.max_length"] == rows.longest
    assert decided.length is not None and decided.length.data_longest == rows.longest
    assert "the data's longest row (read uncut)" in decided.length.explain()
    roomy = planner.plan(cfg, 4 * over, device="cpu", rows=rows)
    assert roomy.length is not None and max(roomy.length.probes) == rows.longest
    assert roomy.settings()["data.max_length"] == rows.longest
    # packed rows fill any length: the data does not bound it
    packed = load_recipe(_recipe(tmp_path, tiny_text_file, checkpointing="full"), ["data.packing=true"])
    assert read_rows(packed).packed
    searched = planner.plan(packed, 4 * over, device="cpu", rows=read_rows(packed)).length
    assert searched is not None and max(searched.probes) > rows.longest


def test_plan_data_with_an_auto_length_reads_the_rows_uncut(tmp_path: Path, tiny_text_file: Path,
                                                            step: int) -> None:
    """`memtrain plan --data` with `data.max_length: auto` reads the data whole (it raised: the data
    cannot be cut before the length is planned) and plans no longer than its longest row."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path, tiny_text_file, checkpointing="full")))
    cfg = load_recipe(str(path))
    budget = int(_total(cfg, 4 * step) / 0.9) + 1
    result = CliRunner().invoke(app, ["plan", str(path), "--budget", str(budget), "--device", "cpu",
                                      "--data", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output[result.output.index("{"):])
    longest = found["max_length"]["data_longest"]
    assert 0 < longest < step and found["settings"]["data.max_length"] == longest


@pytest.mark.parametrize(("value", "message"), [
    ("0", "must be greater than 0"),
    ("-4", "must be greater than 0"),
    ("long", "expected an integer or 'auto'"),
])
def test_bad_lengths_are_refused_naming_the_field(tmp_path: Path, tiny_text_file: Path, value: str,
                                                  message: str) -> None:
    with pytest.raises(RecipeError, match=rf"`data.max_length`: {message}"):
        load_recipe(_recipe(tmp_path, tiny_text_file), [f"data.max_length={value}"])


def test_data_is_not_tokenized_before_the_length_is_planned(tmp_path: Path, tiny_text_file: Path) -> None:
    from memtrain.data.prepare import prepare_data

    with pytest.raises(MemtrainError, match=r"`data.max_length` is `auto`: the planner decides it"):
        prepare_data(load_recipe(_recipe(tmp_path, tiny_text_file)), None)  # type: ignore[arg-type]


@pytest.mark.slow
def test_train_tokenizes_at_the_planned_length_and_says_how_many_examples_were_cut(
        tmp_path: Path, step: int, caplog: pytest.LogCaptureFixture) -> None:
    import io
    import logging

    from rich.console import Console

    from memtrain.run.train import train

    corpus = tmp_path / "long.jsonl"
    words = ["the quick brown fox jumps over the lazy dog"]
    texts = [" ".join(words * (40 if i % 4 == 0 else 1)) for i in range(16)]  # 4 of 16 are long
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in texts), encoding="utf-8")
    recipe = _recipe(tmp_path, corpus, checkpointing="full")
    recipe["training"]["max_steps"] = 1
    cfg = load_recipe(recipe)
    budget = int(_total(cfg, 2 * step) / 0.9) + 1
    assert _total(cfg, 3 * step) > budget * 0.9  # so the plan is 2 steps: the long examples are cut
    recipe["memory"]["budget"] = f"{budget}B"
    cfg = load_recipe(recipe)
    out = io.StringIO()
    with caplog.at_level(logging.WARNING):
        result = train(cfg, Console(file=out, width=200))
    assert f"4 training examples were cut at the planned data.max_length={2 * step}" in out.getvalue()
    assert f"4 of 16 training examples were cut at data.max_length={2 * step}" in caplog.text
    saved = load_recipe(str(result.output_dir / "recipe.yaml"))
    assert saved.data.max_length == 2 * step


@pytest.mark.slow
def test_train_plans_no_longer_than_the_data(tmp_path: Path, tiny_text_file: Path, step: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`train` reads the data uncut before it plans the length: short rows under a budget that fits
    them but not one step of the worst case train at the data's own length, nothing cut (it failed:
    no length fits), and the rows it read are the training data (tokenized once). Planted: `train`
    planning the length without the rows -> raises; tokenizing again at the planned length -> fails."""
    import io

    from rich.console import Console

    from memtrain.data import prepare
    from memtrain.data.prepare import read_rows
    from memtrain.run.train import train

    recipe = _recipe(tmp_path, tiny_text_file, checkpointing="full")
    recipe["training"]["max_steps"] = 1
    cfg = load_recipe(recipe)
    longest = read_rows(cfg).longest
    recipe["memory"]["budget"] = f"{int((_total(cfg, longest) + _total(cfg, step)) / 2 / 0.9)}B"
    out = io.StringIO()
    encoded = []
    real = prepare._encode_dataset
    monkeypatch.setattr(prepare, "_encode_dataset", lambda *a, **k: encoded.append(1) or real(*a, **k))
    result = train(load_recipe(recipe), Console(file=out, width=200))
    assert "the data's longest row" in out.getvalue() and "were cut" not in out.getvalue()
    assert load_recipe(str(result.output_dir / "recipe.yaml")).data.max_length == longest
    assert encoded == [1]  # the rows read uncut are the training data: tokenized once


def test_a_plan_owns_its_traces(tmp_path: Path, tiny_text_file: Path, step: int,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan traces into the cache it is given: planning again with that cache traces nothing
    (the length search's probes and the search after it), a plan with its own cache traces
    everything again (nothing is kept in the process), and the length search's last probe is the
    search's leanest candidate, traced once. Planted: a module-level cache -> the third plan
    traces nothing; plan() not handing its cache to the length search -> the second plan traces."""
    from memtrain.estimator import estimate as est
    from memtrain.plan.search import TraceCache

    cfg = load_recipe(_recipe(tmp_path, tiny_text_file, checkpointing="full", loss="auto"))
    lean = {"memory.loss": "chunked"}
    budget = int((_total(cfg, 3 * step, **lean) + _total(cfg, 4 * step, **lean)) / 2 / 0.9)
    calls: list[tuple[str, int]] = []
    traces = est.trace_candidates_at  # every trace of a search goes through it

    def at(plan: object, points: object, *args: object) -> object:
        calls.append((plan.cfg.memory.loss, plan.seq_len))  # type: ignore[attr-defined]
        return traces(plan, points, *args)

    monkeypatch.setattr(est, "trace_candidates_at", at)
    cache = TraceCache()
    first = planner.plan(cfg, budget, device="cpu", cache=cache)
    traced = list(calls)
    assert len(set(traced)) == len(traced), traced  # nothing traced twice, the leanest at 3 steps included
    assert ("chunked", 3 * step) in traced
    assert planner.plan(cfg, budget, device="cpu", cache=cache).settings() == first.settings()
    assert calls == traced  # all from the cache
    assert planner.plan(cfg, budget, device="cpu").settings() == first.settings()
    assert calls[len(traced):] == traced  # its own cache: the same traces again


def test_the_trace_cache_drops_the_least_recently_used() -> None:
    from memtrain.plan.search import TraceCache

    cache, made = TraceCache(limit=2), []
    make = lambda name: lambda: made.append(name) or name  # noqa: E731
    for name in ("a", "b", "a", "c", "a", "b"):
        cache.estimate("settings", ord(name), make(name))
    assert made == ["a", "b", "c", "b"]  # "a" was used last when "c" came: "b" went
    assert sorted(cache.lengths("settings")) == [ord("a"), ord("b")]


def _kinked(tokens: int) -> int:
    """Llama-3.1-8B QLoRA's leanest peak as the 8 GiB length search saw it (scripts/bench/planner/
    plan_speed.py's plan): 97,164 bytes per token up to 11,520 tokens, 109,441 beyond."""
    if tokens <= 11520:
        return 6_921_817_868 + 97_164 * (tokens - 4096)
    return 7_643_152_038 + 109_441 * (tokens - 11520)


@pytest.mark.parametrize(("usable", "answer"), [(7_730_941_132, 12288), (7_000_000_000, 4864),
                                                 (20_000_000_000, 124416)])
def test_the_solved_length_is_confirmed_only_where_the_line_through_it_agrees(usable: int,
                                                                              answer: int) -> None:
    """The line from 4,096 tokens to the position limit crosses 8 GiB at 11,520 tokens; that length
    fits, and the line through it and the limit crosses at 12,288: the search goes there (it fits,
    and 12,544 does not: the answer) rather than first confirming 11,776, which would only show
    11,520 was short. Planted: confirming every guess that fits -> 6 estimates at 8 GiB, not 5."""
    found = length.LengthSearch(0, 256, usable, {}, limit=131072)
    estimates: list[int] = []

    def at(tokens: int) -> int:
        estimates.append(tokens)
        found.probes[tokens] = _kinked(tokens)
        return found.probes[tokens]

    length._solve(found, at, usable, 256, 131072)
    fits = max(n for n, b in found.probes.items() if b <= usable)
    assert fits == answer and found.probes[answer + 256] > usable  # solved: no regula falsi left
    assert len(estimates) == len(set(estimates)) <= 5, estimates
    if answer == 12288:
        assert estimates == [131072, 4096, 11520, 12288, 12544]
