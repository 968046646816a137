"""Bad arguments to ``prepare_for_budget``, ``attach`` and ``MemoryBudgetCallback``: each is a
MemtrainError naming the plugin's own parameter, the bad value and the fix, raised before anything is
planned or traced (memtrain.plugin.checks). Never pydantic's ValidationError, a bare AttributeError,
a recipe field the user never wrote (``data.max_length``, ``memory.margin``), or a bad value read as
"not given" (``max_length=0`` once planned for an assumed length)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from plain_trainer import arguments, tiny_model
from transformers import Trainer

import memtrain
from memtrain.errors import MemtrainError
from memtrain.plan import planner
from memtrain.plugin.prepare import MemoryBudgetCallback

# A recipe field in backticks, as memtrain's recipe errors name them: never in a plugin error.
RECIPE_FIELD = re.compile(r"`(model|data|adapter|training|memory|output)\.\w")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    args = arguments(tmp_path_factory.mktemp("arguments"), 8, 1, 1)
    return {"model": tiny_model(), "classifier": tiny_model("classification"), "args": args,
            "trainer": Trainer(model=tiny_model(), args=args)}


def prepare(**given: Any) -> Callable[[dict[str, Any]], Any]:
    """prepare_for_budget(tiny Llama, its arguments, "1GiB", max_length=32) with ``given`` replacing
    any of them (``model=``, ``args=``, ``budget=`` too)."""
    def call(s: dict[str, Any]) -> Any:
        values = {"model": s["model"], "args": s["args"], "budget": "1GiB", "max_length": 32, "quiet": True,
                  **given}
        if values["model"] == "classifier":
            values["model"] = s["classifier"]
        return memtrain.prepare_for_budget(values.pop("model"), values.pop("args"), values.pop("budget"),
                                           **values)
    return call


def attach(*positional: Any, **options: Any) -> Callable[[dict[str, Any]], Any]:
    """attach(the Trainer, ...) (a first positional "model" passes the model instead of the Trainer)."""
    def call(s: dict[str, Any]) -> Any:
        if positional and positional[0] == "model":
            return memtrain.attach(s["model"], *positional[1:], **options)
        return memtrain.attach(s["trainer"], *positional, **options)
    return call


def callback(**options: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: MemoryBudgetCallback(**options)


# (call, what the message must hold: the parameter with its bad value, then any other words)
CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], tuple[str, ...]]] = {
    # prepare_for_budget
    "max_length=0": (prepare(max_length=0), ("`max_length=0`", "at least 1")),
    "max_length=-5": (prepare(max_length=-5), ("`max_length=-5`", "at least 1")),
    "max_length=float": (prepare(max_length=64.0), ("`max_length=64.0`", "whole number")),
    "margin=1.5": (prepare(margin=1.5), ("`margin=1.5`", "[0, 1)", "margin=0.1")),
    "margin=str": (prepare(margin="0.1"), ("`margin='0.1'`", "[0, 1)")),
    "budget=0": (prepare(budget=0), ("`budget=0`", "more than 0 bytes")),
    "budget=-1": (prepare(budget=-1), ("`budget=-1`", "more than 0 bytes")),
    "budget=None": (prepare(budget=None), ("`budget=None`", "'24GiB'")),
    "budget=True": (prepare(budget=True), ("`budget=True`", "'24GiB'")),
    "budget=unitless": (prepare(budget="300"), ("`budget='300'`", "'300GiB'")),
    "budget=words": (prepare(budget="12 gigs"), ("`budget='12 gigs'`", "Fix: a size like '24GiB'")),
    "model=str": (prepare(model="qwen2"), ("`model`", "str ('qwen2')", "PreTrainedModel", "peft")),
    "model=module": (prepare(model=torch.nn.Linear(2, 2)),
                     ("`model`", "Linear", "config", "PreTrainedModel")),
    "args=dict": (prepare(args={"per_device_train_batch_size": 8}),
                  ("`args`", "dict ({'per_device_train_batch_size': 8})", "TrainingArguments", "TRL")),
    "quiet=str": (prepare(quiet="yes"), ("`quiet='yes'`", "True or False")),
    "allow_approximate=1": (prepare(allow_approximate=1), ("`allow_approximate=1`", "True or False")),
    "peft_config=dict": (prepare(peft_config={"r": 8}), ("`peft_config={'r': 8}`", "LoraConfig")),
    "rows=int": (prepare(rows=32), ("`rows=32`", "Rows")),
    "memory=list": (prepare(memory=["tiled_mlp"]), ("`memory=['tiled_mlp']`", "dict")),
    "memory=bad value": (prepare(memory={"checkpointing": "partial"}),
                         ("`memory={'checkpointing': 'partial'}`", "'selective'")),
    "memory=unknown key": (prepare(memory={"tiled_mpl": True}), ("`memory={'tiled_mpl': ...}`",
                                                                  "did you mean `tiled_mlp`?")),
    "memory=other tool's name": (prepare(memory={"gradient_checkpointing": "full"}),
                                 ("`memory={'gradient_checkpointing': ...}`",
                                  "did you mean `checkpointing`?")),
    "memory=own argument": (prepare(memory={"margin": 0.3}), ("`memory={'margin': ...}`", "margin=")),
    "memory=a number below its bound": (prepare(memory={"offload": {"min_tensor_bytes": -1}}),
                                        ("`memory={'offload.min_tensor_bytes': -1}`", "0")),
    "memory=a flag for a number": (prepare(memory={"tiled_mlp_tile_tokens": True}),
                                   ("`memory={'tiled_mlp_tile_tokens': True}`", "an integer")),
    "memory=a size with its technique off": (
        prepare(memory={"loss": "standard", "loss_chunk_tokens": 64}),
        ("`memory={'loss_chunk_tokens': 64}`", "`memory={'loss': 'chunked'}`")),
    "memory=chunked loss on a classifier": (prepare(model="classifier", memory={"loss": "chunked"}),
                                            ("`memory={'loss': 'chunked'}`", "causal LMs")),
    "two at once": (prepare(max_length=0, margin=2), ("2 problems", "`max_length=0`", "`margin=2`")),
    # attach
    "trainer=model": (attach("model"), ("`trainer`", "LlamaForCausalLM", "not a Trainer")),
    "attach every=0": (attach(every=0), ("`every=0`", "at least 1", "every=1")),
    "attach every=float": (attach(every=1.5), ("`every=1.5`", "whole number")),
    "attach budget=words": (attach("12 gigs"), ("`budget='12 gigs'`", "'24GiB'")),
    "attach budget=-1": (attach(-1), ("`budget=-1`", "more than 0 bytes")),
    "attach margin=1": (attach("1GiB", margin=1), ("`margin=1`", "[0, 1)")),
    "attach unknown option": (attach(evry=1), ("`evry=`", "did you mean `every`?")),
    "attach prepare's option": (attach(max_length=64), ("`max_length=`", "not an option of attach")),
    "attach simulate_budget=auto": (attach(simulate_budget="auto"), ("`simulate_budget='auto'`", "'2GiB'")),
    "attach simulate_budget=unitless": (attach(simulate_budget="300"),
                                        ("`simulate_budget='300'`", "'300MiB'")),
    "attach predicted=words": (attach(predicted="lots"), ("`predicted='lots'`", "'20GiB'")),
    "attach estimate=str": (attach(estimate="yes"), ("`estimate='yes'`", "'auto'")),
    "attach recover=None": (attach(recover=None), ("`recover=None`", "True or False")),
    "attach simulate=str": (attach(simulate="yes"), ("`simulate='yes'`", "True or False")),
    "callback every=0": (callback(every=0), ("MemoryBudgetCallback: `every=0`",)),
    "callback budget=words": (callback(budget="12 gigs"), ("MemoryBudgetCallback: `budget='12 gigs'`",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_argument_is_named_with_its_value_and_fix_before_any_planning(
        case: str, setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    call, words = CASES[case]

    def planned(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned (traced) before the arguments were checked")

    monkeypatch.setattr(planner, "plan", planned)
    with pytest.raises(MemtrainError) as err:
        call(setup)
    message = str(err.value)
    assert type(err.value) is MemtrainError, message
    who = "attach" if case.startswith(("attach", "trainer")) else (
        "MemoryBudgetCallback" if case.startswith("callback") else "prepare_for_budget")
    assert message.startswith(f"{who}: "), message
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert "Fix: " in message, message
    assert not RECIPE_FIELD.search(message), message
    assert "validation error" not in message, message


def test_a_model_carrying_another_kind_of_adapter_is_named_as_the_model_s(tmp_path: Path) -> None:
    """It was blamed on a `peft_config` argument the user never passed."""
    from peft import IA3Config, get_peft_model

    model = get_peft_model(tiny_model(), IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                   feedforward_modules=["down_proj"]))
    with pytest.raises(MemtrainError) as err:
        memtrain.prepare_for_budget(model, arguments(tmp_path, 8, 1, 1), "1GiB", max_length=32, quiet=True)
    assert "the model carries a IA3Config adapter" in str(err.value) and "peft_config" not in str(err.value)


def test_good_arguments_pass_the_checks(tmp_path: Path) -> None:
    """What the checks take: sizes as str or bytes (a float too), ``auto``, ``margin=0``, every kind of
    ``memory=`` value the docs show, a plan as attach's budget."""
    from memtrain.plugin.checks import callback_problems, check_prepare

    model, args = tiny_model(), arguments(tmp_path, 8, 1, 1)
    for budget in ("24GiB", "auto", 2**30, 1.5e9):
        check_prepare(model, args, budget, allow_approximate=False, max_length=None, margin=0.0, quiet=False,
                      peft_config=None, rows=None, memory=None)
    check_prepare(model, args, "1GiB", allow_approximate=True, max_length=32, margin=0.1, quiet=True,
                  peft_config=None, rows=None, memory={
                      "tiled_mlp": True, "offload": {"activations": True, "min_tensor_bytes": 2**20},
                      "loss_chunk_tokens": 64, "checkpointing": 1, "tiled_mlp_tile_tokens": "auto"})
    assert callback_problems("24GiB", margin=0, predicted="20GiB", simulate=True, simulate_budget=2**30,
                             recover=False, every=1, estimate=False) == []
    assert callback_problems(None, predicted=10**9, estimate="auto") == []
