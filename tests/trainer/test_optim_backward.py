"""Optimizer step inside backward: exact, inside the Trainer (scheduler, checkpoints, resume),
less memory, and refused where it cannot work."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import causal_recipe, tiny_model

from memtrain.config import RecipeError, load_recipe
from memtrain.run.train import train
from memtrain.trainer import optimizer_in_backward as optim_backward
from scripts.probes.memprobe import LiveBytes

FULL = {"adapter": {"method": "full"},
        "training": {"max_grad_norm": None, "learning_rate": 1e-3, "weight_decay": 0.01}}


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def test_parameters_equal_the_ordinary_step_after_five_steps() -> None:
    ordinary, in_backward = tiny_model("llama"), tiny_model("llama")
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.99)}
    opt_a = torch.optim.AdamW(_groups(ordinary), **kwargs)
    opt_b = optim_backward.build(_groups(in_backward), torch.optim.AdamW, kwargs)
    sched_a = torch.optim.lr_scheduler.LinearLR(opt_a, 1.0, 0.2, total_iters=5)
    sched_b = torch.optim.lr_scheduler.LinearLR(opt_b, 1.0, 0.2, total_iters=5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, 512, (2, 16), generator=gen)
        ordinary(input_ids=ids, labels=ids).loss.backward()
        opt_a.step()
        opt_a.zero_grad()
        in_backward(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is None for p in in_backward.parameters())  # stepped and freed in backward
        opt_b.step()
        sched_a.step()
        sched_b.step()
    for (name, a), b in zip(ordinary.named_parameters(), in_backward.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def test_gradients_of_the_whole_model_never_exist() -> None:
    """Independent live-bytes count of forward + backward (+ step) of full fine-tuning."""
    def peak(in_backward: bool) -> int:
        model = tiny_model("llama", num_hidden_layers=4)
        params = list(model.parameters())
        opt = (optim_backward.build([{"params": params}], torch.optim.SGD, {"lr": 0.1}) if in_backward
               else torch.optim.SGD(params, lr=0.1))
        ids = torch.randint(0, 512, (1, 4))  # few activations: gradients make the peak
        with LiveBytes() as probe:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        return probe.device_peak

    grad_bytes = sum(p.numel() * 4 for p in tiny_model("llama", num_hidden_layers=4).parameters())
    assert peak(False) - peak(True) > 0.5 * grad_bytes


def test_state_dict_round_trip_and_mismatch_message() -> None:
    model = tiny_model("llama")
    opt = optim_backward.build([{"params": list(model.parameters())}], torch.optim.AdamW, {"lr": 1e-3})
    ids = torch.randint(0, 512, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    saved = copy.deepcopy(opt.state_dict())
    other = optim_backward.build([{"params": list(model.parameters())}], torch.optim.AdamW, {"lr": 1e-3})
    other.load_state_dict(saved)
    first = next(iter(model.parameters()))
    torch.testing.assert_close(other.state[first]["exp_avg"], opt.state[first]["exp_avg"])
    with pytest.raises(ValueError, match="optimizer_in_backward"):
        other.load_state_dict({"state": {}, "param_groups": []})


def test_trainer_run_equals_the_ordinary_step_and_resumes(tmp_path: Path) -> None:
    """Through `memtrain train`: linear LR schedule, logging, checkpoints, resume."""
    lines = [f"to be or not to be that is the question {i % 4}" for i in range(32)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in lines))
    steps = {"max_steps": 5, "save_strategy": "steps", "save_steps": 3, "save_total_limit": None}
    sections = {**FULL, "training": {**FULL["training"], **steps}}
    runs = {}
    for flag in (False, True):
        recipe = causal_recipe(tmp_path / str(flag), corpus, **sections)
        recipe["training"]["optimizer_in_backward"] = flag
        runs[flag] = train(load_recipe(recipe))
    weights = {k: dict(r.model.named_parameters()) for k, r in runs.items()}
    for name, param in weights[False].items():
        torch.testing.assert_close(weights[True][name], param, rtol=0, atol=1e-6, msg=name)
    # resume the in-backward run from step 3: the same final weights
    out = runs[True].output_dir
    shutil.rmtree(out / "checkpoint-5")
    (out / "metrics.json").unlink()
    recipe = causal_recipe(tmp_path / "True", corpus, **sections)
    recipe["training"]["optimizer_in_backward"] = True
    resumed = train(load_recipe(recipe, ["training.resume=true"]))
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, weights[True][name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(("training", "field"), [
    ({"max_grad_norm": 1.0}, "training.max_grad_norm"),
    ({"max_grad_norm": None, "micro_batch_size": 2, "gradient_accumulation": 4},
     "training.gradient_accumulation"),
    ({"max_grad_norm": None, "micro_batch_size": 2, "effective_batch_size": 8},
     "training.gradient_accumulation"),
])
def test_refused_with_accumulation_or_global_clipping(training: dict, field: str) -> None:
    recipe = {"model": {"name": "x"}, "data": {"source": "x.jsonl"},
              "training": {"optimizer_in_backward": True, **training}}
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    message = str(err.value)
    assert "training.optimizer_in_backward" in message and field in message
