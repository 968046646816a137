"""The plugin's two lines in a user's own TRL ``GRPOTrainer`` script (issue 38, item 1).

``prepare_for_budget`` takes a ``GRPOConfig`` (it used to raise: TRL refuses a new config with both
``generation_batch_size`` and ``steps_per_generation`` set), and ``attach`` traces TRL's own GRPO
training step (its ``compute_loss`` on the worst-case generation output: every completion at
``max_completion_length`` after the longest prompt, the reference log-probabilities at ``beta`` > 0),
refits the micro-batch of completions while keeping the completions generated at once, and states
the generation phase (analytic) and what it does not model in the plan's notes.

Measured by memtrain's meter and by ``scripts/probes/memprobe.py`` (no memtrain code): each step's peak
within [0.95, 1.10] of the prediction (when written: predicted 70,933,056 bytes; measured
68,873,626 and 70,937,732 by the meter, 68,873,618 and 70,937,724 by memprobe: 1.030 and 0.99993).
Planted: completions traced at half ``max_completion_length`` predicts 54.7 MiB for 68.9-70.9 measured,
and fails. Offline: the tiny Llama from its config, the MiniLM tokenizer, prompts made here.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from plain_trainer import tiny_model

import memtrain
from memtrain.estimator.trainer_loss import trainer_step_estimate
from scripts.probes.memprobe import trainer_steps

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

WORDS = ["cat", "dog", "sun", "moon", "tree", "river", "stone", "bird"]
KIB = 1 / 1024  # in MiB
COMMON = {"learning_rate": 1e-3, "logging_steps": 1, "report_to": "none", "use_cpu": True,
          "save_strategy": "no", "seed": 0, "bf16": False, "disable_tqdm": True}


def prompts() -> Any:
    rnd = random.Random(0)
    return datasets.Dataset.from_list([{"prompt": "name a word: " + " ".join(
        rnd.choice(WORDS) for _ in range(rnd.randint(2, 6)))} for _ in range(32)])


def short(completions: list[str], **_: Any) -> list[float]:
    """The user's reward: shorter completions score higher."""
    return [-len(c) / 50 for c in completions]


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def config(tmp_path: Path) -> Any:
    return trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, num_generations=4, max_completion_length=16,
                          beta=0.04, max_steps=2, **COMMON)


@pytest.fixture(scope="module")
def tok(tokenizer: Any) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = tok.sep_token  # generation stops at the end-of-sequence token
    return tok


def test_a_grpo_script_with_the_two_lines_is_refitted_planned_and_measured(
        tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str]) -> None:
    reference = trl.GRPOTrainer(model=tiny_model(), args=config(tmp_path / "ref"), reward_funcs=short,
                                train_dataset=prompts(), processing_class=tok, peft_config=lora())
    whole = trainer_step_estimate(reference)  # micro-batch 4 completions, beta > 0: the reference's logps
    assert whole.modelled and "ref_per_token_logps" in whole.batch
    assert whole.batch["completion_ids"] == (4, 16)
    budget = int(whole.peak_bytes * 0.95 / 0.9)  # 4 completions per micro-batch are over the usable budget

    # the user's script, with the two lines
    args = config(tmp_path / "run")
    assert (args.generation_batch_size, args.steps_per_generation) == (8, 2)
    longest = whole.batch["prompt_ids"][1] + 16  # prompt + completion: the planner's search stays short
    model, args = memtrain.prepare_for_budget(tiny_model(), args, budget, peft_config=lora(),
                                              max_length=longest)
    trainer = trl.GRPOTrainer(model=model, args=args, reward_funcs=short, train_dataset=prompts(),
                              processing_class=tok, peft_config=lora())
    counter = trainer_steps()
    trainer.add_callback(counter)
    callback = memtrain.attach(trainer, every=1)

    plan = model.memtrain_plan
    said = " ".join(capsys.readouterr().err.split())
    assert "┃ setting" in said
    assert "GRPO generation phase (HF generate; the prefill traced, the rest analytic)" in said
    assert "num_generations=4: modelled" in said and "max_completion_length=16" in said
    found = callback.trainer_estimate
    assert found.modelled and found.batch["completion_ids"] == (2, 16) and callback.usable >= found.peak_bytes
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 4)
    # the same completions per generation and per optimizer step: whole groups of num_generations
    assert (trainer.args.generation_batch_size, trainer.args.steps_per_generation) == (8, 4)
    assert plan.predicted_peak == callback.predicted >= found.peak_bytes
    trainer.train()
    assert trainer.state.global_step == 2
    measured = [m.peak_bytes for m in callback.steps.values()]
    counted = [s["peak"] for s in counter.steps]  # scripts/probes/memprobe.py
    assert len(counted) == 2 and all(0.95 <= callback.predicted / c <= 1.10 for c in measured + counted), (
        callback.predicted, measured, counted)
    # each phase logged apart, measured (the meter's generation phase: inside the model's generate)
    # against its own prediction; the step's peak is the larger phase's
    assert plan.phase_peaks == callback.predicted_phases
    assert max(plan.phase_peaks.values()) == plan.predicted_peak
    logged = [e for e in trainer.state.log_history if "memory/peak_mib" in e]
    assert len(logged) == 2, trainer.state.log_history

    for entry in logged:
        generation, training = entry["memory/generation_peak_mib"], entry["memory/training_peak_mib"]
        assert entry["memory/peak_mib"] == max(generation, training) and 0 < generation < training, entry
        for phase in ("generation", "training"):
            predicted = entry[f"memory/predicted_{phase}_peak_mib"]
            assert predicted == plan.phase_peaks[phase] / 2**20, entry
            assert 0.95 <= predicted / entry[f"memory/{phase}_peak_mib"] <= 1.10, (phase, entry)
            assert entry[f"memory/{phase}_error_pct"] == pytest.approx(
                100 * (predicted / entry[f"memory/{phase}_peak_mib"] - 1)), entry
    for phase in ("generation", "training"):  # at least the worst step's, to the KiB
        # (training, when written: 70,937,744 predicted, 70,937,732 measured; without the 3 other
        # micro-batches of completions TRL's buffer holds, 3,108 bytes short: fails)
        assert max(e[f"memory/{phase}_peak_mib"] for e in logged) - KIB <= plan.phase_peaks[phase] / 2**20


@pytest.mark.parametrize("setting", [
    pytest.param({"peft": False, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                  "num_generations": 8, "max_completion_length": 64, "beta": 0.0}, marks=pytest.mark.long),
    {"peft": True, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4,
     "max_completion_length": 64, "beta": 0.04, "temperature": 0.8, "top_p": 0.9},
], ids=["full-G8-64", "lora-G4-64-top_p"])
def test_each_phase_is_predicted_for_settings_users_vary(tmp_path: Path, tok: Any,
                                                          setting: dict[str, Any]) -> None:
    """Issue 38's targets through the plugin: for each phase, the logged prediction is at least the worst
    measured (memtrain's meter; its generation phase is memprobe's within 0.04%, tests/end_to_end/
    test_grpo.py) and at most 1.10 x it; full fine-tuning with 8 completions per prompt and LoRA with 4,
    completions of 64 tokens, the second sampling with temperature and top_p. When written: generation
    1.0014 / 1.0022, training 1.0124 / 0.99999999 (predicted / worst measured: 4 bytes short of
    626,549,512, a scalar; hence "at least" within a KiB). Found by this test: TRL left-pads prompts, and
    the 4-D attention mask it then builds (8 x 76 x 76 bytes, saved for backward) was not traced;
    planted back (the batch traced unpadded), the LoRA row fails by 46,213 bytes."""
    setting = dict(setting)
    peft = lora() if setting.pop("peft") else None
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=2, **setting, **COMMON)
    model, args = memtrain.prepare_for_budget(tiny_model(), args, "2GiB", peft_config=peft, quiet=True)
    trainer = trl.GRPOTrainer(model=model, args=args, reward_funcs=short, train_dataset=prompts(),
                              processing_class=tok, peft_config=peft)
    memtrain.attach(trainer, every=1)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "memory/peak_mib" in e]
    assert len(logged) == 2, trainer.state.log_history
    for phase in ("generation", "training"):
        worst = max(e[f"memory/{phase}_peak_mib"] for e in logged)
        predicted = logged[-1][f"memory/predicted_{phase}_peak_mib"]
        assert worst - KIB <= predicted <= 1.10 * worst, (phase, predicted, worst)


def test_a_grpo_config_without_an_adapter_at_beta_0_plans_no_reference(tmp_path: Path, tok: Any) -> None:
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, beta=0.0, max_steps=1, use_vllm=False, **COMMON)
    model, args = memtrain.prepare_for_budget(tiny_model(), args, "2GiB", quiet=True)
    trainer = trl.GRPOTrainer(model=model, args=args, reward_funcs=short, train_dataset=prompts(),
                              processing_class=tok)
    callback = memtrain.attach(trainer)
    found = callback.trainer_estimate
    assert found.modelled and "ref_per_token_logps" not in found.batch and trainer.ref_model is None
    assert not any("ref_model=" in note for note in model.memtrain_plan.notes)
    assert (trainer.args.generation_batch_size, trainer.args.steps_per_generation) == (
        trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps,
        trainer.args.gradient_accumulation_steps)


def test_an_out_of_memory_grpo_step_is_redone_on_the_same_completions(tmp_path: Path, tok: Any) -> None:
    """``attach`` puts recovery in front of TRL's own GRPO step: an out-of-memory error in the backward
    of the second micro-batch of 4 completions (LoRA, beta 0.04: reference log-probs, TRL's default
    loss) is redone in halves on the completions already generated, and the run's gradients and losses
    are those of the same script without the error (tests/reliability/test_grpo_recovery.py does
    the same through ``memtrain train``)."""
    from plain_trainer import GradCapture, max_grad_difference

    def run(folder: str, fail: bool) -> tuple[Any, GradCapture, list[int]]:
        args = config(tmp_path / folder)
        args.max_grad_norm = 0.0  # no clipping: it would hide a wrongly scaled gradient
        trainer = trl.GRPOTrainer(model=tiny_model(), args=args, reward_funcs=short, train_dataset=prompts(),
                                  processing_class=tok, peft_config=lora())
        capture = GradCapture()
        trainer.add_callback(capture)
        memtrain.attach(trainer, budget="2GiB")
        raised: list[int] = []
        backwards = [0]
        mlp = next(m for name, m in trainer.model.named_modules() if name.endswith("layers.0.mlp"))

        def hook(module: Any, grad_in: Any, grad_out: Any) -> None:
            backwards[0] += 1
            if fail and backwards[0] == 2 and not raised:
                raised.append(int(grad_out[0].shape[0]))
                raise torch.OutOfMemoryError("injected: 4 completions do not fit")

        mlp.register_full_backward_hook(hook)
        trainer.train()
        return trainer, capture, raised

    ref, ref_grads, _ = run("ref", fail=False)
    rec, rec_grads, raised = run("rec", fail=True)
    assert raised == [4]
    logged = [e for e in rec.state.log_history if "memory/recovered_micro_batch" in e]
    assert [(e["step"], e["memory/recovered_micro_batch"]) for e in logged] == [(1, 2)], rec.state.log_history
    assert len(rec_grads.grads) == len(ref_grads.grads) == 2
    for a, b in zip(ref_grads.grads, rec_grads.grads, strict=True):
        assert max(float(g.abs().max()) for g in a.values()) > 1e-4  # the rewards differ: a real gradient
        assert max_grad_difference(a, b) < 1e-4
    for key in ("loss", "reward"):
        ref_values = [e[key] for e in ref.state.log_history if key in e]
        rec_values = [e[key] for e in rec.state.log_history if key in e]
        assert len(rec_values) == 2 and rec_values == pytest.approx(ref_values, rel=1e-4, abs=1e-7), key
