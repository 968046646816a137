"""The plugin in TRL's trainers (trl 1.16).

Out-of-memory recovery: DPO with LoRA and SFT with padding-free packing, under a simulated budget
that forces a split, train exactly as without it; DPO's evaluation pieces put back together give
the whole batch's metrics; a loss that couples the batch is refused with a message in the plugin
user's terms.

The prediction: ``attach`` traces the trainer's own step (TRL's fused log-prob head, DPO's
``[chosen; rejected]`` rows and reference forward, the adapter TRL's ``peft_config=`` adds), so
every logged predicted peak is within [0.95, 1.15] of the measured one, by memtrain's meter and by
``scripts/probes/memprobe.py`` (no memtrain code); a step it cannot trace is said to be not modelled.

Offline: tiny Llama from its config, the MiniLM tokenizer, preference pairs and texts generated
here. Every TRL config sets ``bf16=False``: TRL defaults to bf16 autocast, which on a CPU rounds
a half-batch differently from a whole one (about 1e-3 of DPO's gradient, whose chosen and rejected
terms nearly cancel at the start) and would hide what recovery does.
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
from memtrain.reliability.recovery import UnsplittableBatch
from scripts.probes.memprobe import trainer_steps

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

WORDS = ["cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish", "cloud", "rain", "wind"]
COMMON = {"learning_rate": 1e-3, "logging_steps": 1, "report_to": "none", "use_cpu": True,
          "save_strategy": "no", "seed": 0, "bf16": False, "disable_tqdm": True,
          "train_sampling_strategy": "sequential"}
MiB = 2**20


@pytest.fixture(scope="module")
def tok(tokenizer: Any) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = tok.sep_token  # TRL appends EOS to every completion
    return tok


def phrase(rnd: random.Random, low: int, high: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(low, high)))


def preference_pairs(count: int = 32) -> Any:
    rnd = random.Random(0)
    return datasets.Dataset.from_list([{"prompt": f"question {i}: {phrase(rnd, 3, 8)}",
                                        "chosen": phrase(rnd, 2, 10), "rejected": phrase(rnd, 2, 10)}
                                       for i in range(count)])


def lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def dpo(tmp_path: Path, tok: Any, steps: int = 4, pairs: Any = None, **config: Any) -> Any:
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=steps,
                         per_device_eval_batch_size=8, **{**COMMON, **config})
    return trl.DPOTrainer(model=tiny_model(), args=args, train_dataset=pairs or preference_pairs(),
                          eval_dataset=preference_pairs(16), processing_class=tok, peft_config=lora())


def logged(trainer: Any, key: str) -> list[float]:
    return [e[key] for e in trainer.state.log_history if key in e and "loss" in e]


def train_measured(trainer: Any, budget: int | None = None) -> Any:
    callback = memtrain.attach(trainer, simulate_budget=budget, every=1)
    trainer.train()
    return callback


@pytest.mark.parametrize("precompute", [False, pytest.param(True, marks=pytest.mark.long)],
                         ids=["reference-forward", "precomputed-reference"])
def test_dpo_under_a_budget_that_forces_a_split_trains_as_without_it(tmp_path: Path, tok: Any,
                                                                     precompute: bool) -> None:
    ref = dpo(tmp_path / "ref", tok, precompute_ref_log_probs=precompute)
    peaks = [m.peak_bytes for m in train_measured(ref).steps.values()]
    budget = int(0.7 * max(peaks))  # 8 pairs do not fit; 4 do
    run = dpo(tmp_path / "run", tok, precompute_ref_log_probs=precompute)
    callback = train_measured(run, budget)
    assert [(e["micro_batch_before"], e["micro_batch"], e["unit"]) for e in callback.recovery.events] == [
        (8, 4, "preference pair")]  # the user's 8 pairs, not the collator's 16 rows
    assert run.state.global_step == ref.state.global_step == 4
    for key in ("loss", "grad_norm", "logps/chosen"):
        assert logged(run, key) == pytest.approx(logged(ref, key), rel=1e-4, abs=1e-7), key
    # a margin is beta x a difference of two log-ratios of ~50 nats each: fp32 rounding of the
    # halves' sums (which differs by CPU: 1.9e-7 on an AMD EPYC) is ~1e-7 of a 1e-3 margin; a lost
    # or doubled pair moves it by the margin's own size
    margins = logged(ref, "rewards/margins")
    assert logged(run, "rewards/margins") == pytest.approx(margins, rel=1e-4, abs=1e-6)
    assert max(map(abs, margins)) > 1e-4  # the bound is well below what it compares
    assert logged(run, "num_tokens") == logged(ref, "num_tokens")  # each micro-batch counted once
    assert max(m.peak_bytes for m in callback.steps.values()) <= budget
    recovered = [e for e in run.state.log_history if "memory/recovered_micro_batch" in e]
    assert [(e["step"], e["memory/recovered_micro_batch"]) for e in recovered] == [(1, 4.0)]


def test_dpo_evaluation_in_pieces_gives_the_whole_batch_metrics(tmp_path: Path, tok: Any) -> None:
    trainer = dpo(tmp_path, tok)
    expected = trainer.evaluate()
    whole = trainer.predict(trainer.eval_dataset)  # logits and labels: 16 rows per batch, [chosen; rejected]
    raised: list[int] = []

    def fail(module: Any, args: Any, out: torch.Tensor) -> None:
        if out.shape[0] > 8:  # 16 rows: 8 chosen + 8 rejected sequences
            raised.append(int(out.shape[0]))
            raise torch.OutOfMemoryError("injected: 8 pairs do not fit")

    callback = memtrain.attach(trainer)  # (before the hook: attach traces the step on fake tensors)
    trainer.model.get_base_model().model.layers[0].mlp.register_forward_hook(fail)
    got = trainer.evaluate()
    assert raised == [16] and callback.eval_recovery.events == [{"eval_batch_before": 8, "eval_batch": 4}]
    for key in ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/rejected"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    pieces = trainer.predict(trainer.eval_dataset)  # put back in the batch's order, not piece by piece
    assert (pieces.label_ids == whole.label_ids).all()
    assert abs(pieces.predictions - whole.predictions).max() < 1e-4


def test_a_dpo_loss_that_couples_the_batch_stops_cleanly_in_plugin_terms(tmp_path: Path, tok: Any) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    trainer = dpo(tmp_path, tok, steps=1, loss_type=["sigmoid", "sft"])
    with pytest.raises(UnsplittableBatch) as err:
        train_measured(trainer, 150 * MiB)
    message = str(err.value)
    assert "micro-batch of 8 preference pairs" in message and "DPOTrainer" in message
    assert "['sft']" in message and "`per_device_train_batch_size`" in message
    assert "memory." not in message.split("The error was")[0]  # no recipe fields for a plugin user
    assert trainer.state.global_step == 0
    assert not _get_current_dispatch_mode_stack()  # the simulated budget and the meter were left


def test_sft_with_padding_free_packing_under_a_budget_splits_between_sequences(tmp_path: Path,
                                                                              tok: Any) -> None:
    rnd = random.Random(0)
    texts = datasets.Dataset.from_list([{"text": phrase(rnd, 4, 40)} for _ in range(64)])

    def sft(folder: str) -> Any:
        args = trl.SFTConfig(output_dir=str(tmp_path / folder), per_device_train_batch_size=2, max_steps=3,
                             packing=True, max_length=128, **COMMON)
        return trl.SFTTrainer(model=tiny_model(), args=args, train_dataset=texts, processing_class=tok)

    ref = sft("ref")
    assert ref.padding_free  # BFD packing: one row per batch, sequences told apart by position_ids
    peaks = [m.peak_bytes for m in train_measured(ref).steps.values()]
    budget = int(0.7 * max(peaks))
    run = sft("run")
    callback = train_measured(run, budget)
    events = callback.recovery.events
    assert events and events[0]["unit"] == "packed sequence" and events[0]["micro_batch"] < events[0][
        "micro_batch_before"]
    for key in ("loss", "grad_norm"):
        assert logged(run, key) == pytest.approx(logged(ref, key), rel=1e-4), key
    assert logged(run, "num_tokens") == logged(ref, "num_tokens")
    assert max(m.peak_bytes for m in callback.steps.values()) <= budget


# ------------------------------------------------------------------------------- the prediction
# Rows of nearly one length, so that every batch is about as large as the longest one (what the
# prediction is for): each logged step can then be held to it.


def ratios(trainer: Any) -> list[float]:
    logged_steps = [e for e in trainer.state.log_history if "memory/peak_mib" in e]
    assert logged_steps and all("memory/predicted_peak_mib" in e for e in logged_steps)
    return [e["memory/predicted_peak_mib"] / e["memory/peak_mib"] for e in logged_steps]


def test_sft_with_peft_config_the_logged_prediction_is_the_trainers_own_step(tmp_path: Path,
                                                                             tok: Any) -> None:
    rnd = random.Random(0)
    texts = datasets.Dataset.from_list([{"text": phrase(rnd, 30, 34)} for _ in range(32)])
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, max_length=64,
                         **COMMON)  # TRL's default gradient_checkpointing=True: memtrain's patch does it
    model, args = memtrain.prepare_for_budget(tiny_model(), args, "2GiB", peft_config=lora(), quiet=True)
    plan = model.memtrain_plan
    assert plan.settings["adapter"] == "lora r=8" and plan.settings["checkpointing"] == "full"
    assert plan.settings["max_length"] == 64 and not plan.settings["packed"]  # read from the SFTConfig
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tok,
                             peft_config=lora())
    callback = memtrain.attach(trainer, every=1)
    found = callback.trainer_estimate
    longest = max(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert found.modelled and found.batch["input_ids"] == (4, longest)  # the longest rows, TRL's collator
    assert plan.predicted_peak == found.peak_bytes
    assert any("SFTTrainer's own training_step" in note for note in plan.notes)
    trainer.train()
    assert all(0.95 <= r <= 1.15 for r in ratios(trainer)), ratios(trainer)


def test_dpo_with_peft_config_over_budget_is_refitted_and_predicted(tmp_path: Path, tok: Any) -> None:
    rnd = random.Random(1)
    pairs = datasets.Dataset.from_list([{"prompt": f"question {i}: {phrase(rnd, 5, 6)}",
                                         "chosen": phrase(rnd, 6, 7), "rejected": phrase(rnd, 6, 7)}
                                        for i in range(32)])
    trainer = dpo(tmp_path, tok, steps=3, pairs=pairs)
    whole = trainer_step_estimate(trainer)  # 8 pairs: 16 rows through the policy and the reference
    assert whole.batch["input_ids"][0] == 16
    budget = int(whole.peak_bytes * 0.95 / 0.9)  # 8 pairs are over the usable budget (margin 0.1)
    counter = trainer_steps()
    trainer.add_callback(counter)
    callback = memtrain.attach(trainer, budget, every=1)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)
    assert callback.trainer_estimate.peak_bytes <= callback.usable
    trainer.train()
    assert all(0.95 <= r <= 1.15 for r in ratios(trainer)), ratios(trainer)
    assert max(m.peak_bytes for m in callback.steps.values()) <= callback.usable
    counted = [s["peak"] for s in counter.steps]  # scripts/probes/memprobe.py: no memtrain code
    assert len(counted) == 3 and all(0.95 <= callback.predicted / c <= 1.15 for c in counted), counted


def test_a_step_that_cannot_be_traced_is_said_to_be_not_modelled(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from plain_trainer import collate, token_dataset
    from transformers import Trainer, TrainingArguments

    class NumpyWeighted(Trainer):  # a loss that reads values through numpy: no fake tensor can
        def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, **kwargs: Any) -> Any:
            weight = float((inputs["labels"] >= 0).float().mean().numpy())
            return model(**inputs).loss * weight

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, **COMMON)
    trainer = NumpyWeighted(model=tiny_model(), args=args, data_collator=collate,
                            train_dataset=token_dataset("causal-lm", [12, 16, 9, 14]))
    callback = memtrain.attach(trainer, "1GiB", every=1)
    assert not callback.trainer_estimate.modelled and "numpy" in callback.trainer_estimate.reason
    assert "NumpyWeighted's training step is not modelled" in caplog.text
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "memory/peak_mib" in e)
    assert "memory/predicted_peak_mib" not in entry  # no prediction for a loss it did not trace


def test_sft_packed_with_peft_config_the_printed_plan_is_the_traced_step(
        tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 35: prepare_for_budget cannot see TRL's loss, so it prints no table that would not run;
    attach prints the plan whose peak and micro-batch both come from the trainer's traced step."""
    from memtrain.units import format_bytes

    rnd = random.Random(0)
    texts = datasets.Dataset.from_list([{"text": phrase(rnd, 30, 34)} for _ in range(48)])
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                         gradient_accumulation_steps=2, packing=True, **COMMON)  # no max_length: 1024
    model, args = memtrain.prepare_for_budget(tiny_model(), args, "2GiB", peft_config=lora())
    plan = model.memtrain_plan
    said = " ".join(capsys.readouterr().err.split())
    assert plan.pending and "┃ setting" not in said and "computes its own loss" in said
    assert plan.settings["max_length"] == 256  # TRL's 1024 capped by the model's positions
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tok,
                             peft_config=lora())
    counter = trainer_steps()
    trainer.add_callback(counter)
    callback = memtrain.attach(trainer, every=1)
    found = callback.trainer_estimate
    said = " ".join(capsys.readouterr().err.split())
    assert found.modelled and plan.predicted_peak == found.peak_bytes == callback.predicted
    assert f"memtrain attach: predicted peak {format_bytes(found.peak_bytes)}" in said and "┃ setting" in said
    # TRL packs padding-free: the traced batch is one row of the packed rows end to end, and the plan's
    # length is that row's, which the notes say beside the rows of 256 they read
    assert found.batch["input_ids"][0] == 1 and plan.settings["max_length"] > 256
    assert (f"one flattened row of {plan.settings['max_length']:,} tokens (the collator lays its rows of up "
            "to 256 tokens end to end)") in " ".join(plan.notes), plan.notes
    micro = (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps)
    assert micro == (found.micro_batch, found.accumulation) == (
        plan.settings["per_device_train_batch_size"], plan.settings["gradient_accumulation_steps"])
    trainer.train()
    # scripts/probes/memprobe.py, once optimizer state exists
    counted = [s["peak"] for s in counter.steps][1:]
    assert counted and all(0.9 <= callback.predicted / c <= 1.1 for c in counted), (
        callback.predicted, counted)


def test_a_separate_reference_model_is_counted_and_said_to_be(tmp_path: Path, tok: Any) -> None:
    """Full fine-tuning with TRL's ``ref_model``: the step attach traces holds the reference's
    weights beside the policy's, the plan's note says the peak counts them, and the logged
    prediction is the measured step's. Planted: the reference left out of the weights the trace
    fakes (``trainer_loss._trace``) fails it (the step is then not modelled); the note's old text
    ("not that copy's bytes") fails it."""
    policy = tiny_model()
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, **COMMON)
    policy, args = memtrain.prepare_for_budget(policy, args, "2GiB", quiet=True)
    reference = copy.deepcopy(policy)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args,
                             train_dataset=preference_pairs(16), processing_class=tok)
    callback = memtrain.attach(trainer, every=1)
    found = callback.trainer_estimate
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert found.modelled and found.by_category["parameters"] >= 2 * weights, found.by_category
    said = [n for n in policy.memtrain_plan.notes if n.startswith("ref_model=")]
    assert len(said) == 1 and ": modelled:" in said[0] and "counts that copy's weights" in said[0], said
    trainer.train()
    assert all(0.95 <= r <= 1.15 for r in ratios(trainer)), ratios(trainer)


def test_an_adapter_only_the_trainer_was_given_is_in_the_plan(tmp_path: Path, tok: Any) -> None:
    """TRL's ``peft_config=`` given to the SFTTrainer and not to prepare_for_budget: the traced step
    trains the adapter, and the plan says it does (it said `full`), with a note that its techniques
    were planned for full fine-tuning. Planted: the label left as planned -> fails."""
    rnd = random.Random(0)
    texts = datasets.Dataset.from_list([{"text": phrase(rnd, 30, 34)} for _ in range(16)])
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, max_length=64,
                         **COMMON)
    model, args = memtrain.prepare_for_budget(tiny_model(), args, "2GiB", quiet=True)
    plan = model.memtrain_plan
    assert plan.settings["adapter"] == "full"
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tok,
                             peft_config=lora())
    callback = memtrain.attach(trainer)
    assert callback.trainer_estimate.modelled
    assert plan.settings["adapter"] == "lora r=8", plan.settings
    assert any("prepare_for_budget was not given" in note for note in plan.notes), plan.notes
