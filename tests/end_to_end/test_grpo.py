"""``training.objective: grpo`` end to end: recipes/tiny-llama-grpo.yaml trains through TRL's
GRPOTrainer, both rewards score its completions and the mean reward rises; the estimate (no weights)
and train's own prediction match the measured step; bad GRPO input exits 2 naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe, shipped_recipes_dir

RECIPE = shipped_recipes_dir() / "tiny-llama-grpo.yaml"
runner = CliRunner()


def bad_reward(**_: object) -> list[float]:
    raise ValueError("no score for you")


def _validate(*overrides: str) -> str:
    result = runner.invoke(app, ["validate", str(RECIPE), "--data", *overrides])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize(("overrides", "field", "fix"), [
    (["training.grpo_rewards=[]"], "training.grpo_rewards", "name at least one"),
    (["training.grpo_rewards=[no_such_module_x:f]"], "training.grpo_rewards", "cannot be imported"),
    ([f"training.grpo_rewards=[{__name__}:bad_reward]"], "training.grpo_rewards", "no score for you"),
    (["training.grpo_num_generations=5"], "training.grpo_num_generations", "multiple of 5"),
    (["training.grpo_loss=ppo"], "training.grpo_loss", "dapo"),
    (["training.grpo_max_completion_length=220"], "data.max_length", "or less"),
])
def test_bad_grpo_input_exits_2_naming_the_field(overrides: list[str], field: str, fix: str) -> None:
    out = _validate(*overrides)
    assert field in out and fix in out, out


def test_validate_reads_the_data_once_and_calls_the_rewards_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`validate --data` of the shipped GRPO recipe prepares its prompts once: the rows it reports
    are the rows the reward check is called on (it prepared them twice, reading and tokenizing every
    row again)."""
    from memtrain.data import prepare

    calls = []
    real = prepare.prepare_data
    monkeypatch.setattr(prepare, "prepare_data", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = runner.invoke(app, ["validate", str(RECIPE), "--data"])
    assert result.exit_code == 0, result.output
    assert "data read:" in result.output and len(calls) == 1, (calls, result.output)


@pytest.mark.slow
@pytest.mark.long  # 20 steps; the recipe trains through `memtrain train` in the suite (generation phase)
def test_grpo_recipe_reward_rises(tmp_path: Path) -> None:
    """The shipped recipe as it is (20 steps, seed 0): TRL generates, both rewards score every logged
    step, and the mean reward of the last three logs beats that of the first three by a clear
    margin. What rises is the format reward (a random completion is words only ~70% of the time;
    the policy learns to answer in words); exact_answer stays near 0 in so short a run. When
    written: first three logs 0.81, 0.69, 0.66 (mean 0.72), last three 0.88, 0.91, 0.97 (mean 0.92);
    87 s on this 2-core CPU shared with other work (load 5), ~35 s alone. Planted:
    learning_rate 1e-12 (0 is refused) -> 0.79 then 0.74, fails; the format reward's sign flipped
    (grpo_reward_weights [1, -1]) -> the format reward falls (0.79 then 0.69), fails."""
    from memtrain.run.train import train

    cfg = load_recipe(RECIPE, [f"output.dir={tmp_path / 'run'}"])
    result = train(cfg)
    logs = [e for e in result.log_history if "reward" in e]
    assert len(logs) >= 10, result.log_history  # the first step and every 2 of 20
    for log in logs:
        assert {"rewards/exact_answer/mean", "rewards/format/mean"} <= log.keys(), log
        assert 0.0 <= log["reward"] <= 2.0 and log["completions/max_length"] <= 2, log
    for key in ("reward", "rewards/format/mean"):  # the total, and the format reward itself (unweighted)
        values = [log[key] for log in logs]
        first, last = sum(values[:3]) / 3, sum(values[-3:]) / 3
        assert last > first + 0.15, (key, first, last, values)
    # the report compares the measured step with a prediction for its own generated batch (its
    # prompts' and completions' lengths), not with the worst case (+23% when it was)
    from memtrain.memory.report import load_report

    report = load_report(result.output_dir)
    rows, prompt, completion = report.measured["batch"]
    assert (rows, completion) == (32, 2) and prompt <= report.predicted["batch"][1]
    assert report.compared()["peak_bytes"] == pytest.approx(report.measured["peak_bytes"], rel=0.01)


@pytest.mark.slow
def test_grpo_training_step_is_predicted_within_5_percent(tmp_path: Path) -> None:
    """``memtrain estimate`` of a GRPO recipe (no weights loaded) traces TRL's own training step
    (memtrain.estimator.grpo_step: the GRPOTrainer built around the fake model, its compute_loss on
    the worst-case generation output: 16 completions of 2 tokens after the longest prompt; beta 0, so
    no reference log-probs), and so does ``memtrain train`` before its first step (on the built
    Trainer); the memory report compares with the estimate. Prompts of one length make every step
    the worst case; each step's peak, by memtrain's meter and by scripts/probes/memprobe.py (no memtrain
    code), is within 5% of both predictions. On a CPU TRL's fused head scores every position (prompt
    too) in fp32 with entropy, ~8 tensors of rows x tokens x 30,522 fp32 values at the peak, which
    the causal-LM trace ``memtrain estimate`` used before does not hold (301.8 MiB against 636-761
    MiB measured in the issue's run). When written (the recipe trained in full, micro-batch 16):
    estimate, report and train's trace 564.05 MiB; measured 548.45 (first step: no optimizer state
    yet) and 564.05 MiB, by the meter and by memprobe. With LoRA, beta 0.04, 8 x 2 accumulation and
    8-token completions (not in this test): 321.37 MiB predicted, 321.24 / 321.57 measured."""
    import json

    from memtrain.data.prepare import read_rows
    from memtrain.estimator.estimate import estimate
    from memtrain.estimator.grpo_step import grpo_notes
    from memtrain.run.train import train
    from scripts.probes.memprobe import trainer_steps

    words = ["thou", "art", "my", "lord", "and", "the", "night", "is", "long"]
    rows = [{"prompt": "Which play is this line from? " + " ".join(words[(i + k) % 9] for k in range(24)),
             "answer": "Hamlet"} for i in range(64)]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    cfg = load_recipe(RECIPE, [f"output.dir={tmp_path / 'run'}", "training.max_steps=2",
                               "training.logging_steps=1", f"data.source={source}", "data.max_examples=64",
                               "training.micro_batch_size=16"])
    estimated = estimate(cfg, rows=read_rows(cfg))  # `memtrain estimate --data`: no weights
    notes = grpo_notes(cfg, estimated.device, estimated.settings["seq_len"])  # as `memtrain estimate` says
    assert "TRL's own GRPOTrainer training_step" in notes[0], notes
    counter = trainer_steps()
    result = train(cfg, callbacks=[counter])
    logged = [e for e in result.log_history if "memory/peak_mib" in e]
    assert len(logged) == 2 and all("memory/predicted_peak_mib" in e for e in logged), result.log_history
    report = json.loads((tmp_path / "run" / "memory_report.json").read_text(encoding="utf-8"))
    compared = report.get("same_batch") or report["predicted"]  # the report's comparison
    predictions = {"estimate": estimated.peak_bytes / 2**20, "report": compared["peak_bytes"] / 2**20,
                   "train": logged[0]["memory/predicted_peak_mib"]}
    measured = [e["memory/peak_mib"] for e in logged] + [s["peak"] / 2**20 for s in counter.steps]
    assert all(0.95 <= p / m <= 1.05 for p in predictions.values() for m in measured), (predictions, measured)



class _Generations:
    """A callback that counts every ``generate`` call of a run with scripts/probes/memprobe.py (no memtrain
    code): what exists when it starts (:func:`resident`: weights, buffers, optimizer state) plus the
    live bytes its own tensors reach (:class:`LiveBytes`)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        self.calls: list[tuple[int, int, int, int]] = []  # rows, prompt tokens, resident, peak
        calls = self.calls

        class Probe(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                               optimizer: Any = None, **_: Any) -> None:
                import types

                from scripts.probes.memprobe import LiveBytes, resident

                stock = model.generate

                def generate(_: Any, *a: Any, **k: Any) -> Any:
                    inner = getattr(optimizer, "optimizer", optimizer)
                    held = resident(model, inner, {}, "cpu")
                    probe = LiveBytes()
                    probe.adopt([k.get("input_ids"), k.get("attention_mask")])
                    with probe:
                        out = stock(*a, **k)
                    calls.append((int(k["input_ids"].shape[0]), int(k["input_ids"].shape[1]), held,
                                  held + probe.device_peak))
                    return out

                model.generate = types.MethodType(generate, model)

        self.callback = Probe()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # full fine-tuning, 4 prompts x 8, temperature 1 (the recipe's own settings; 83 s in the suite)
    pytest.param(["training.grpo_max_completion_length=64"], marks=pytest.mark.long),
    ["training.grpo_max_completion_length=64", "training.micro_batch_size=8",
     "training.gradient_accumulation=2", "training.grpo_num_generations=4"],  # 16 generated at once
    # HF's top-p sorts the vocabulary: the sampling step's largest processor (each processor alone:
    # tests/estimator/test_generation_sampling.py, in the suite)
    pytest.param(["training.grpo_max_completion_length=32", "adapter.method=lora",
                  "training.grpo_temperature=0.7", "training.grpo_top_p=0.9"], marks=pytest.mark.long),
], ids=["full-64", "accumulated-64", "lora-temperature-top_p"])
def test_the_generation_phase_is_predicted_within_10_percent(tmp_path: Path, overrides: list[str]) -> None:
    """The generation phase (memtrain.estimator.grpo.generation_memory: HF ``generate`` of a whole
    generation batch, micro-batch x steps_per_generation completions, at full length: the KV cache,
    the prompts' prefill, the sampling step's fp32 tensors) against every ``generate`` call of a real
    ``memtrain train`` run, counted by scripts/probes/memprobe.py: predicted >= measured and <= 1.10 x
    measured. Completions always reach ``max_completion_length`` here (a random model's chance of the
    end-of-sequence token is 1 in 30,522), so each call is the worst case. When written: 24.69 /
    24.41, 16.87 / 16.63 with 128-token completions (16.25 / 16.10 at the suite's 64, since 2026-12-04),
    and with temperature 0.7 and top_p 0.9 (32-token completions) 48.56 / 48.36 MiB (1.00-1.01;
    without top_p counted: 0.58). Before (weights + KV + 2 logits, the
    recipe estimate's model): 16.8 MiB for 24.4 measured. Planted: 3 sampling copies instead of 4 ->
    0.86, fails; the generation batch taken as the micro-batch -> the row count fails.
    The run's logs have the same phase apart (``memory/generation_peak_mib``, the meter inside
    ``generate``: within 1% of memprobe's count; when written 24.417 / 24.408 and 40.066 / 40.057
    MiB) and its prediction (``memory/predicted_generation_peak_mib``: 40.55 MiB for the worst 40.06).
    Planted: the meter not told of generation -> no such log entry, fails."""
    from memtrain.estimator.grpo import generation_phase
    from memtrain.run.train import train

    cfg = load_recipe(RECIPE, [f"output.dir={tmp_path / 'run'}", "training.max_steps=2",
                               "data.max_length=128", *overrides])
    probe = _Generations()
    result = train(cfg, callbacks=[probe.callback])
    assert len(probe.calls) == 2, probe.calls
    logged = [e for e in result.log_history if "memory/peak_mib" in e]
    assert len(logged) == 2, result.log_history
    for (rows, prompt, held, measured), entry in zip(probe.calls, logged, strict=True):
        assert rows == cfg.training.micro_batch_size * cfg.training.gradient_accumulation
        predicted = generation_phase(cfg, prompt, resident=held).peak_bytes  # the recipe's batch
        assert measured <= predicted <= 1.10 * measured, (rows, prompt, predicted / 2**20, measured / 2**20)
        # the run's own logs: the meter's generation phase is what memprobe counted in generate
        assert entry["memory/generation_peak_mib"] == pytest.approx(measured / 2**20, rel=0.01), entry
    # the logged prediction (the built Trainer's worst case: its longest prompt, optimizer state held)
    # against the worst generation measured
    worst = max(measured for *_, measured in probe.calls) / 2**20
    assert worst <= logged[-1]["memory/predicted_generation_peak_mib"] <= 1.10 * worst, logged
