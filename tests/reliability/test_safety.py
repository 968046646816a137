"""No lost work: SIGTERM and resume, crashes mid-checkpoint, disk space, NaN losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import causal_recipe
from transformers import Trainer, TrainerCallback

from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.reliability.checkpoints import STAGING, last_complete_checkpoint
from memtrain.run.train import train


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"now is the winter of our discontent {i}"})
                              for i in range(64)))
    return path


def step_losses(history: list[dict]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


@pytest.mark.slow
@pytest.mark.long  # resume in the suite: tests/reliability/test_reliability.py
def test_sigterm_saves_and_resume_matches_an_uninterrupted_run(tmp_path: Path, corpus: Path) -> None:
    sections = {"training": {"max_steps": 8, "logging_steps": 1}}
    reference = train(load_recipe(causal_recipe(tmp_path / "ref", corpus, **sections)))

    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump(causal_recipe(tmp_path / "killed", corpus, **sections)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", "train", str(recipe)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    logged, output = 0, []
    assert proc.stdout is not None
    for line in proc.stdout:
        output.append(line)
        logged += "'loss'" in line
        if logged == 3:
            proc.send_signal(signal.SIGTERM)
            break
    output += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM, "".join(output)
    text = "".join(output)
    assert "Traceback" not in text
    assert "training.resume=true" in text
    out = tmp_path / "killed" / "run"
    saved = last_complete_checkpoint(out)
    assert saved is not None and 3 <= int(saved.name.split("-")[1]) < 8
    assert not (out / "metrics.json").exists()

    resumed = train(load_recipe(recipe, ["training.resume=true"]))
    assert resumed.log_history[-1]["step"] == 8
    want = step_losses(reference.log_history)
    for step, loss in step_losses(resumed.log_history).items():
        assert loss == pytest.approx(want[step], rel=1e-5), step
    assert resumed.metrics["epoch"] == pytest.approx(reference.metrics["epoch"])


def test_crash_during_a_checkpoint_write_leaves_the_last_complete_one(
        tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saves = {"n": 0}
    real = Trainer._save_rng_state

    def crash_on_second_save(self, output_dir):  # model and optimizer written, then the crash
        saves["n"] += 1
        if saves["n"] == 2:
            raise OSError("simulated crash mid-save")
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", crash_on_second_save)
    sections = {"training": {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}}
    with pytest.raises(OSError, match="simulated crash"):
        train(load_recipe(causal_recipe(tmp_path, corpus, **sections)))
    out = tmp_path / "run"
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()
    assert (out / STAGING / "checkpoint-4").is_dir()  # the half-written one, out of resume's way
    (out / "checkpoint-9").mkdir()  # a stray folder without trainer_state.json is ignored too
    assert last_complete_checkpoint(out) == out / "checkpoint-2"

    monkeypatch.setattr(Trainer, "_save_rng_state", real)
    ran = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ran.append(state.global_step)

    train(load_recipe(causal_recipe(tmp_path, corpus, **sections), ["training.resume=true"]),
          callbacks=[Steps()])
    assert ran == [3, 4]
    assert not (out / STAGING).exists()


def test_checkpoint_refused_when_the_disk_is_full(tmp_path: Path, corpus: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("memtrain.reliability.checkpoints.shutil.disk_usage",
                        lambda path: usage._replace(free=1000))
    sections = {"training": {"max_steps": 2, "save_strategy": "steps", "save_steps": 1}}
    with pytest.raises(MemtrainError, match=r"Disk full: not enough space to save checkpoint-1: it needs"):
        train(load_recipe(causal_recipe(tmp_path, corpus, **sections)))
    assert last_complete_checkpoint(tmp_path / "run") is None


class PoisonLoss(TrainerCallback):
    """Makes the loss NaN during the given optimizer steps; records a LoRA weight before each."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.handle = None
        self.before: dict[int, torch.Tensor] = {}  # step -> lora_B weight when the step begins

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1
        lora = next(p for n, p in model.named_parameters() if "lora_B" in n)
        self.before[step] = lora.detach().clone()
        if step in self.steps:
            self.handle = model.register_forward_hook(
                lambda mod, inp, out: out.__class__(**{**out, "loss": out["loss"] * float("nan")}))

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_a_nan_step_is_skipped_and_training_goes_on(tmp_path: Path, corpus: Path) -> None:
    poison = PoisonLoss({3})
    result = train(load_recipe(causal_recipe(tmp_path, corpus, training={"max_steps": 5})),
                   callbacks=[poison])
    assert result.log_history[-1]["step"] == 5
    assert not torch.equal(poison.before[3], poison.before[2])  # step 2 updated the weights
    assert torch.equal(poison.before[4], poison.before[3])  # step 3 (NaN) left them alone
    assert not torch.equal(poison.before[5], poison.before[4])  # and training went on
    assert all(torch.isfinite(w).all() for w in poison.before.values())


def test_persistent_nan_stops_with_the_last_good_checkpoint(tmp_path: Path, corpus: Path) -> None:
    sections = {"training": {"max_steps": 12, "save_strategy": "steps", "save_steps": 2,
                             "max_nonfinite_steps": 2}}
    # steps 5, 6, 7 are NaN: the third in a row stops the run. checkpoint-6 was saved after two
    # skipped steps, which changed nothing, so it holds the weights of step 4.
    with pytest.raises(MemtrainError, match=r"NaN or infinite in 3 optimizer steps in a row.*checkpoint-6"):
        train(load_recipe(causal_recipe(tmp_path, corpus, **sections)),
              callbacks=[PoisonLoss(set(range(5, 13)))])
    out = tmp_path / "run"
    assert not (out / "metrics.json").exists()
    from safetensors.torch import load_file

    four, six = (load_file(out / f"checkpoint-{n}" / "adapter_model.safetensors") for n in (4, 6))
    assert four.keys() == six.keys() and all(torch.equal(four[k], six[k]) for k in four)
