"""The plugin right by default (issue 35, part 2): without ``max_length=`` it plans for the data the
Trainer is handed (its longest batch through its collator, read at ``attach``), never beyond the
model's positions, and says what it assumed until then; every Trainer option of
:mod:`memtrain.plugin.options` is modelled or said not to be; importing it prints nothing.

Measured by ``scripts/probes/memprobe.py`` (no memtrain code), on a tiny Mistral (256 positions) with a
small vocabulary, so that the planner runs in seconds."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import TINY_CONFIGS
from plain_trainer import arguments, collate
from transformers import AutoConfig, AutoModelForCausalLM, Trainer

import memtrain
from memtrain.errors import MemtrainError
from memtrain.plugin.options import RULES, Seen, option_notes
from scripts.probes.memprobe import trainer_steps

VOCAB = 512


def mistral(**overrides: Any) -> torch.nn.Module:
    values = {**copy.deepcopy(TINY_CONFIGS["mistral"]), "vocab_size": VOCAB, **overrides}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))


def rows(lengths: list[int]) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, VOCAB, (n,), generator=gen).tolist()} for n in lengths]


def test_without_max_length_a_trainer_script_is_planned_for_its_data_and_measured_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, args = memtrain.prepare_for_budget(mistral(), arguments(tmp_path, 8, 1, 3), "400MiB")
    plan = model.memtrain_plan
    assert (plan.length_from, plan.settings["max_length"], plan.pending) == ("assumed", 256, True)
    said = capsys.readouterr().err
    assert "assumed rows of 256 tokens (the model's 256 positions)" in " ".join(said.split())
    assert "┃ setting" not in said  # no table for a plan that will not run
    trainer = Trainer(model=model, args=args, train_dataset=rows([38, 30, 36, 38] * 6), data_collator=collate)
    counter = trainer_steps()
    trainer.add_callback(counter)
    callback = memtrain.attach(trainer, every=1)
    assert callback.plan is plan and (plan.length_from, plan.settings["max_length"]) == ("the data", 38)
    assert plan.settings["per_device_train_batch_size"] == trainer.args.per_device_train_batch_size
    said = " ".join(capsys.readouterr().err.split())
    assert f"predicted peak {memtrain_bytes(plan.predicted_peak)}" in said and "rows of 38 tokens" in said
    trainer.train()
    # scripts/probes/memprobe.py; the first step holds no optimizer state yet (docs/plugin.md): from the
    # second
    measured = [s["peak"] for s in counter.steps][1:]
    assert measured and all(0.9 <= callback.predicted / m <= 1.1 for m in measured), (callback.predicted,
                                                                                     measured)


def memtrain_bytes(n: int) -> str:
    from memtrain.units import format_bytes

    return format_bytes(n)


def test_the_plan_never_goes_beyond_the_models_positions(tmp_path: Path) -> None:
    with pytest.raises(MemtrainError, match=r"`max_length=300` is more than the 256 positions"):
        memtrain.prepare_for_budget(mistral(), arguments(tmp_path, 2, 1, 1), "400MiB", max_length=300)
    model, args = memtrain.prepare_for_budget(mistral(max_position_embeddings=64),
                                              arguments(tmp_path, 2, 1, 1), "400MiB", quiet=True)
    assert model.memtrain_plan.settings["max_length"] == 64  # assumed: the positions, not 512
    trainer = Trainer(model=model, args=args, train_dataset=rows([90, 20]), data_collator=collate)
    memtrain.attach(trainer)  # the data has longer rows than the model takes: planned for 64, said
    plan = model.memtrain_plan
    assert plan.settings["max_length"] == 64
    assert any("more than the model's 64 positions" in n for n in plan.notes)


GRPO = {"num_generations": 4, "max_completion_length": 16, "generation_batch_size": 8}
ATTRIBUTES = ("padding_free", *GRPO, "use_vllm", "use_transformers_continuous_batching")
SETUPS: dict[str, Any] = {  # rule -> (TrainingArguments extras, model overrides, collator)
    "torch_compile": ({"torch_compile": True}, {}, None),
    "use_liger_kernel": ({"use_liger_kernel": True}, {}, None),
    "gradient_checkpointing_kwargs": ({"gradient_checkpointing": True,
                                       "gradient_checkpointing_kwargs": {"use_reentrant": True}}, {}, None),
    "attn_implementation=eager": ({}, {"attn_implementation": "eager"}, None),
    "attn_implementation=flex": ({}, {"attn_implementation": "flex_attention"}, None),
    "use_kernels": ({}, {"use_kernels": True}, None),  # what from_pretrained leaves from 5.25
    "neftune_noise_alpha": ({"neftune_noise_alpha": 5.0}, {}, None),
    "optim": ({"optim": "lion_32bit"}, {}, None),
    "padding_free": ({"padding_free": True}, {}, None),
    "data_collator": ({}, {}, "flattening"),
    # TRL's GRPOConfig fields, set on plain TrainingArguments as padding_free is
    "num_generations": ({**GRPO}, {}, None),
    "use_vllm": ({**GRPO, "use_vllm": True}, {}, None),
    "use_transformers_continuous_batching": ({**GRPO, "use_transformers_continuous_batching": True}, {},
                                             None),
    "ref_model": ({}, {}, "reference"),  # a Trainer holding a reference model of its own
}


def _rule_id(rule: Any) -> str:
    if rule.option == "attn_implementation":
        return "attn_implementation=" + ("eager" if rule.modelled else "flex")  # flash is modelled too
    return rule.option


@pytest.mark.parametrize("rule", RULES, ids=_rule_id)
def test_every_trainer_option_is_modelled_or_said_not_to_be(rule: Any, tmp_path: Path) -> None:
    from transformers import DataCollatorWithFlattening

    extras, overrides, collator = SETUPS[_rule_id(rule)]
    args: Any = arguments(tmp_path, 2, 1, 1, **{k: v for k, v in extras.items() if k not in ATTRIBUTES})
    for name in ATTRIBUTES:  # TRL's configs have them; a plain TrainingArguments does not
        if name in extras:
            setattr(args, name, extras[name])
    model = mistral()
    if "attn_implementation" in overrides:  # flex needs no compile here: the config says it
        model.config._attn_implementation = overrides["attn_implementation"]
    if "use_kernels" in overrides:  # kernelizing needs the Hub; the flag is what the plugin reads
        model._use_kernels = True
    trainer = SimpleNamespace(ref_model=mistral()) if collator == "reference" else None
    seen = Seen(args, model, DataCollatorWithFlattening() if collator == "flattening" else None, trainer)
    notes = option_notes(seen)
    said = [n for n in notes if n.startswith(rule.option)]
    assert len(said) == 1, notes
    assert (": modelled:" in said[0]) == rule.modelled and (": not modelled:" in said[0]) != rule.modelled
    assert option_notes(Seen(arguments(tmp_path, 2, 1, 1), mistral())) == []  # none set: nothing said


def test_the_options_reach_the_plan_and_the_estimate(tmp_path: Path) -> None:
    from memtrain.plugin.describe import recipe_for

    args = arguments(tmp_path, 2, 1, 1, torch_compile=True, neftune_noise_alpha=5.0, optim="lion_32bit")
    model, new_args = memtrain.prepare_for_budget(mistral(), args, "400MiB", max_length=16, quiet=True)
    notes = " ".join(model.memtrain_plan.notes)
    for option in ("torch_compile=True: not modelled", "neftune_noise_alpha=5.0: not modelled",
                   "optim='lion_32bit': not modelled"):
        assert option in notes
    assert str(new_args.optim.value) == "lion_32bit"  # the user's optimizer stays
    eager = mistral()
    eager.set_attn_implementation("eager")
    assert recipe_for(eager, args, 16).model.attn_implementation == "eager"  # traced as eager
    assert recipe_for(mistral(), args, 16).model.attn_implementation == "sdpa"


def test_importing_the_plugin_prints_nothing() -> None:
    root = Path(__file__).resolve().parents[2]
    # both forms in one process (each import costs seconds): the second runs memtrain's lazy names
    code = "from memtrain import prepare_for_budget, attach\nimport memtrain.plugin"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr


@pytest.mark.long  # the plugin's nothing-fits message, in the suite: tests/plugin/test_plugin_plan.py
def test_when_attach_re_plans_and_nothing_fits_it_says_attach_and_the_rows(tmp_path: Path) -> None:
    """Nothing fits the assumed length, so prepare_for_budget leaves the plan to attach; when nothing
    fits the Trainer's batch either, the error is attach's and names the rows it planned for (it
    read 'prepare_for_budget: nothing fits', a call that had returned)."""
    # the techniques fixed and an 8-bit optimizer (no other is tried): the searches are of the batch
    # alone (every technique planned: minutes, two searches of the whole space)
    fixed = {"checkpointing": "full", "loss": "chunked", "offload.activations": False,
             "offload.embeddings": False, "tiled_mlp": False, "lean_norm": False}
    model, args = memtrain.prepare_for_budget(mistral(), arguments(tmp_path, 8, 1, 3, optim="adamw_bnb_8bit"),
                                              "1MiB", quiet=True, memory=fixed)
    assert model.memtrain_plan.pending
    trainer = Trainer(model=model, args=args, train_dataset=rows([38, 30] * 8), data_collator=collate)
    with pytest.raises(MemtrainError) as err:
        memtrain.attach(trainer)
    assert str(err.value).startswith("attach (the Trainer's longest batch, rows of 38 tokens): nothing fits "
                                     "budget=1.00 MiB"), err.value
