"""prepare_for_budget: every causal LM / sequence classifier plans, the decision is shown and attached,
errors speak the plugin's arguments, re-runs are idempotent, the user's checkpointing is never doubled."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_CONFIGS
from plain_trainer import arguments, collate, tiny_model, token_dataset
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Trainer

from memtrain.errors import MemtrainError
from memtrain.plan import planner
from memtrain.plugin.describe import BudgetPlan, recipe_for
from memtrain.plugin.prepare import MemoryBudgetCallback, prepare_for_budget

# the techniques a test leaves alone, so that its plans search only what it checks (every technique
# planned: three searches of the whole space, 94 s of the suite for the 8-bit test)
OFF = {"offload.activations": False, "offload.embeddings": False, "tiled_mlp": False, "lean_norm": False}


def gpt2() -> torch.nn.Module:
    values = copy.deepcopy(TINY_CONFIGS["gpt2"])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))


def smallest_peaks(model: torch.nn.Module, args: Any, memory: dict[str, Any] | None = None,
                   optimizers: tuple[str, ...] = ("adamw", "adamw_8bit")) -> dict[str, int]:
    """The smallest peak the plugin's planner can reach with each of ``optimizers`` (as
    prepare_for_budget asks, with the ``memory`` fields it is given fixed): a plan each, with
    every technique searched (~25 s on the project's 2-core CPU)."""
    from memtrain.plugin.apply import planned_fields

    base = recipe_for(model, args, max_length=32)
    auto = planned_fields(memory, False, 0.1, False)  # every technique the plugin may choose
    peaks = {}
    for optimizer in optimizers:
        with pytest.raises(planner.NothingFits) as err:
            planner.plan(planner.with_values(base, {**auto, "training.optimizer": optimizer}), 2**20)
        peaks[optimizer] = err.value.smallest.min_peak
    return peaks


def test_gpt2_and_a_bert_classifier_plan_and_the_callback_takes_the_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = arguments(tmp_path, 8, 1, 1)
    model, new_args = prepare_for_budget(gpt2(), args, "1GiB", max_length=32)  # GPT2LMHeadModel
    plan = model.memtrain_plan
    assert isinstance(plan, BudgetPlan) and 0 < plan.predicted_peak <= plan.usable
    assert plan.settings["per_device_train_batch_size"] == new_args.per_device_train_batch_size == 8
    shown = capsys.readouterr().err
    assert "predicted peak" in shown and "your settings fit as they are" in shown
    callback = MemoryBudgetCallback(plan)  # the plan itself: no log line to parse
    assert (callback.budget, callback.usable, callback.predicted) == (plan.budget, plan.usable,
                                                                      plan.predicted_peak)
    classifier = tiny_model("classification")  # BertForSequenceClassification, 2 labels, from config
    assert recipe_for(classifier, args, 32).model.task == "sequence-classification"
    model, _ = prepare_for_budget(classifier, args, "1GiB", max_length=32, quiet=True)
    assert model.memtrain_plan.predicted_peak > 0
    # quiet=True: no summary, no table (log records still follow the user's logging setup, which
    # another test in the same process may have pointed at stderr)
    assert "memtrain prepare_for_budget:" not in capsys.readouterr().err
    with pytest.raises(MemtrainError, match=r"`budget='24 gigs'`.*Fix: a size like '24GiB'"):
        prepare_for_budget(classifier, args, "24 gigs")
    encoder = AutoModel.from_config(classifier.config)  # a BertModel: no training head
    with pytest.raises(MemtrainError, match=r"BertModel.*AutoModelForSequenceClassification \(\['Bert"):
        prepare_for_budget(encoder, args, "1GiB", max_length=32)


def test_a_choice_without_accumulation_predicts_its_own_peak(tmp_path: Path) -> None:
    """The search bounds every micro-batch by a trace beside an earlier micro-batch's gradients;
    the chosen 8 x 1 holds none, and its predicted peak is that of a step without them."""
    from memtrain.estimator.estimate import estimate

    args = arguments(tmp_path, 8, 1, 1)  # effective batch 8: micro-batches 1, 2, 4, 8 are choices
    model, _ = prepare_for_budget(gpt2(), args, "1GiB", max_length=32, quiet=True)
    plan = model.memtrain_plan
    chosen = plan.settings
    assert (chosen["per_device_train_batch_size"], chosen["gradient_accumulation_steps"]) == (8, 1)
    alone = planner.with_values(recipe_for(gpt2(), args, max_length=32), {
        "training.micro_batch_size": 8, "training.gradient_accumulation": 1,
        "training.effective_batch_size": None})
    assert plan.predicted_peak == estimate(alone, device="cpu").total_bytes


def test_switching_to_8bit_adamw_is_stated_and_nothing_fits_speaks_the_plugins_arguments(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = arguments(tmp_path, 16, 1, 1)
    # checkpointing planned, the other techniques fixed: the optimizer is what is tested
    fixed = {**OFF, "loss": "chunked"}
    peaks = smallest_peaks(gpt2(), args, fixed)
    assert peaks["adamw_8bit"] < peaks["adamw"]
    budget = int((peaks["adamw_8bit"] + peaks["adamw"]) / 2 / 0.9)  # only the 8-bit optimizer fits
    model, new_args = prepare_for_budget(gpt2(), args, budget, max_length=32, memory=fixed)
    assert new_args.optim == "adamw_bnb_8bit"
    changes = {c.setting: c for c in model.memtrain_plan.changes}
    assert changes["optim"].yours == "adamw_torch_fused" and changes["optim"].now == "adamw_bnb_8bit"
    assert "adamw_bnb_8bit" in capsys.readouterr().err  # said, not only done
    with pytest.raises(MemtrainError) as err:
        prepare_for_budget(gpt2(), args, "1MiB", max_length=32, quiet=True, memory=fixed)
    message = str(err.value)
    assert "nothing fits budget=1.00 MiB" in message and "memory." not in message and "auto" not in message
    assert "optim='adamw_bnb_8bit' (8-bit AdamW)" in message  # the smallest peak's optimizer is named
    assert "with your optim='adamw_torch_fused'" in message
    assert "per_device_train_batch_size=1, gradient_accumulation_steps=16" in message  # its settings
    # the techniques it turns on, by their memory= names; not every one left off ("activations False")
    assert " False" not in message and " None" not in message, message


def layer_calls(model: torch.nn.Module) -> list[int]:
    """How many times layer 0 starts running (a pre-hook: a recompute stops early, after what backward
    needs, before the layer's last modules return)."""
    calls = [0]
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_user_checkpointing_is_planned_once_and_rerunning_is_idempotent(tmp_path: Path) -> None:
    from memtrain.patches import records

    args = arguments(tmp_path, 4, 1, 1, gradient_checkpointing=True)
    model = tiny_model()
    peaks = smallest_peaks(model, args, OFF, optimizers=("adamw",))  # checkpointing and the loss planned
    budget = int(peaks["adamw"] / 0.9) + 2**16  # needs checkpointing even without the user's flag
    for _ in range(2):  # a notebook cell run twice on the same model
        model, new_args = prepare_for_budget(model, args, budget, max_length=32, quiet=True, memory=OFF)
    assert [r.name for r in records(model)].count("checkpointing") == 1
    assert model.memtrain_plan.settings["checkpointing"] == "full"
    assert "gradient_checkpointing" in {c.setting for c in model.memtrain_plan.changes}
    assert new_args.gradient_checkpointing is False  # memtrain's patch checkpoints; never both
    calls = layer_calls(model)
    trainer = Trainer(model=model, args=new_args, train_dataset=token_dataset("causal-lm", [32] * 4),
                      data_collator=collate)
    trainer.train()
    # each micro-batch runs the layer twice: its forward and one recompute (not 3: doubled or nested)
    assert calls[0] == 2 * new_args.gradient_accumulation_steps


def test_the_recipe_describes_the_weights_as_stored_not_the_first_parameter(
        tmp_path: Path, tiny_text_file: Path) -> None:
    from conftest import causal_recipe
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from memtrain.config import load_recipe
    from memtrain.model import load_model

    args = arguments(tmp_path, 4, 1, 1)
    model = tiny_model().to(torch.bfloat16)
    model.get_input_embeddings().float()  # an fp32 embedding first, bf16 everywhere else
    assert next(model.parameters()).dtype == torch.float32
    assert recipe_for(model, args, 32).model.dtype == "bf16"
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file,
                                    model={"dtype": "bf16", "quantization": "nf4", "double_quant": False}))
    qlora = prepare_model_for_kbit_training(load_model(cfg.model))  # its unquantized weights now fp32
    qlora = get_peft_model(qlora, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    described = recipe_for(qlora, args, 32).model
    assert (described.quantization, described.dtype, described.compute_dtype) == ("nf4", "bf16", "bf16")
    assert described.double_quant is False


@pytest.mark.parametrize("arch", ["gpt2", "bert"])  # Llama and Qwen2 scripts: test_plugin, test_recovery
def test_a_plain_trainer_script_per_architecture_plans_logs_and_recovers(arch: str, tmp_path: Path) -> None:
    """The two lines of docs/plugin.md in a plain Trainer script, and an out-of-memory error."""
    from transformers import AutoModelForSequenceClassification

    import memtrain

    values = copy.deepcopy(TINY_CONFIGS[arch])
    config = AutoConfig.for_model(values.pop("model_type"), **values, num_labels=2)
    task = "classification" if arch == "bert" else "causal-lm"
    auto = AutoModelForSequenceClassification if arch == "bert" else AutoModelForCausalLM
    torch.manual_seed(0)
    model, args = memtrain.prepare_for_budget(auto.from_config(config), arguments(tmp_path, 4, 1, 2),
                                              "1GiB", max_length=32, quiet=True)
    raised: list[int] = []

    def out_of_memory_over_two_rows(module: torch.nn.Module, positional: tuple, kwargs: dict) -> None:
        rows = kwargs["input_ids"].shape[0]
        if rows > 2:
            raised.append(rows)
            raise torch.OutOfMemoryError(f"injected: {rows} rows do not fit")

    model.register_forward_pre_hook(out_of_memory_over_two_rows, with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(task, [16] * 8),
                      data_collator=collate)
    callback = memtrain.attach(trainer)  # the plan prepare_for_budget left on the model
    trainer.train()
    assert trainer.state.global_step == 2 and raised == [4]  # split once, pieces of 2 from then on
    assert callback.recovery is not None and callback.recovery.parts == 2
    assert callback.predicted == model.memtrain_plan.predicted_peak
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert logged and all("memory/peak_mib" in e and "memory/predicted_peak_mib" in e for e in logged)


def test_the_plan_table_keeps_setting_names_whole_in_a_narrow_terminal() -> None:
    """At 80 columns the long reasons wrap and the names stay whole (they were cut to
    `per_device_tr…`). (Planted: the default columns -> fails.)"""
    from rich.console import Console

    from memtrain.plugin.describe import Change

    names = ["per_device_train_batch_size", "gradient_accumulation_steps", "memory.offload.activations"]
    why = "the largest micro-batch that fits the budget; accumulation keeps your effective batch " * 2
    plan = BudgetPlan(2**30, 2**29, "cuda", 2**28, {"max_length": 512},
                      changes=[Change(name, "adamw_torch_fused", "adamw_bnb_8bit", why) for name in names])
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(plan.table())
    text = console.export_text()
    assert all(name in text for name in names), text
    assert max(map(len, text.splitlines())) <= 80
