"""The plugin's arguments checked before anything is traced or changed.

``prepare_for_budget``, ``attach`` and ``MemoryBudgetCallback`` call these first: a value of the
wrong type or out of range is a :class:`~memtrain.errors.MemtrainError` that names the parameter
as the user wrote it (``max_length=0``, ``margin=1.5``, ``memory={'checkpointing': 'partial'}``,
``model``, ``args``), the value, and the fix, never pydantic's error, a bare ``AttributeError``,
or a recipe field the user never wrote (the plugin describes the user's setup as a recipe,
:mod:`memtrain.plugin.describe`). A bad value is never read as "not given". Each problem is a
:class:`memtrain.config.Problem` (field, value, fix, as a recipe's problems are); a call's problems
are reported together.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import re
from typing import Any

import yaml
from torch import nn
from transformers import PretrainedConfig, Trainer, TrainingArguments

from memtrain import patches
from memtrain.config import Problem, RecipeError, load_recipe
from memtrain.config.base import MISSING
from memtrain.config.suggest import did_you_mean
from memtrain.data.rows import Rows
from memtrain.errors import MemtrainError
from memtrain.plugin.apply import planned_fields
from memtrain.plugin.describe import OWN_ARGUMENTS, BudgetPlan, memory_fields, task_of
from memtrain.units import budget_problem, parse_size

BUDGET_FIX = "a size like '24GiB', a number of bytes, or 'auto' (the device's free memory)."
MODEL_FIX = ("pass the model your Trainer trains: a transformers PreTrainedModel (e.g. "
             "AutoModelForCausalLM.from_pretrained(...)) or a peft model wrapping one.")
ARGS_FIX = ("pass your Trainer's arguments: a transformers TrainingArguments (or a TRL config such as "
            "SFTConfig or GRPOConfig, which are TrainingArguments).")


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    lines = repr(value).splitlines() or [""]
    text = lines[0] + ("..." if len(lines) > 1 else "")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def given(name: str, value: Any, message: str, fix: str) -> Problem:
    """A problem with argument ``name``: shown as the user wrote it, ``name=value``."""
    return Problem(f"{name}={shown(value)}", MISSING, message, fix)


def raise_problems(who: str, problems: list[Problem]) -> None:
    """One :class:`MemtrainError` for all of ``problems`` (none: nothing raised)."""
    if len(problems) == 1:
        raise MemtrainError(f"{who}: {problems[0]}")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise MemtrainError(f"{who}: {len(problems)} problems:\n{lines}")


def is_whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def flag(name: str, value: Any) -> list[Problem]:
    if isinstance(value, bool):
        return []
    return [given(name, value, "must be True or False", f"{name}=True or {name}=False.")]


def fraction(name: str, value: Any, usual: str) -> list[Problem]:
    if is_number(value) and 0 <= value < 1:
        return []
    return [given(name, value, "must be a fraction of the budget in [0, 1)",
                  f"e.g. {name}=0.1 ({usual}).")]


def size(name: str, value: Any, *, auto: bool = True, fix: str = BUDGET_FIX) -> list[Problem]:
    """A memory size: ``"24GiB"``, a positive number of bytes, or (``auto``) ``"auto"``."""
    if isinstance(value, str):
        why = budget_problem(value) if auto or value != "auto" else "cannot be 'auto' here"
        return [given(name, value, why, fix)] if why else []
    if is_number(value) and value > 0:
        return []
    what = "more than 0 bytes" if is_number(value) else "a size (a str like '24GiB', or a number of bytes)"
    return [given(name, value, f"must be {what}", fix)]


# ---------------------------------------------------------------------------- prepare_for_budget


def check_prepare(model: Any, args: Any, budget: Any, *, allow_approximate: Any, max_length: Any,
                  margin: Any, quiet: Any, peft_config: Any, rows: Any, memory: Any) -> None:
    """``prepare_for_budget``'s arguments, each of the type and range it takes.

    Raises:
        MemtrainError: every problem found, each naming its argument, its value and the fix.
    """
    problems = model_problems(model)
    if not isinstance(args, TrainingArguments):
        fix = ARGS_FIX + (" A dict of settings: TrainingArguments(**settings)."
                          if isinstance(args, dict) else "")
        problems.append(Problem("args", MISSING, f"is a {type(args).__name__} ({shown(args)}), not training "
                                "arguments", fix))
    problems += size("budget", budget)
    problems += flag("allow_approximate", allow_approximate) + flag("quiet", quiet)
    if max_length is not None and not (is_whole(max_length) and max_length >= 1):
        problems.append(given("max_length", max_length, "must be a whole number of tokens, at least 1",
                              "max_length= of your longest tokenized example (e.g. max_length=1024), or "
                              "leave it out to plan for the Trainer's data (docs/plugin.md, \"The length "
                              "planned for\")."))
    problems += fraction("margin", margin, "the default: a tenth of the budget kept free for what "
                         "estimates miss")
    if peft_config is not None and type(peft_config).__name__ != "LoraConfig":
        problems.append(given("peft_config", peft_config, f"is a {type(peft_config).__name__}; memtrain "
                              "estimates LoRA adapters", "a peft LoraConfig, or leave peft_config out."))
    if rows is not None and not (isinstance(rows, Rows) and is_whole(rows.longest) and rows.longest >= 1):
        problems.append(given("rows", rows, "must be a memtrain.data.rows.Rows whose longest row is at "
                              "least 1 token", "rows=Rows(longest=..., uniform=..., packed=..., read=True), "
                              "or leave rows out (max_length= gives the length)."))
    if memory is not None and not (isinstance(memory, dict) and all(isinstance(k, str) for k in memory)):
        problems.append(given("memory", memory, "must be a dict of memory settings by name", "e.g. "
                              "memory={'tiled_mlp': True, 'offload.activations': True} (docs/plugin.md)."))
    raise_problems("prepare_for_budget", problems)
    inner = patches.base_model(model)
    task = task_of(inner)  # a model of a task memtrain does not estimate: its own message
    if memory:
        memory_fields(memory)  # a key memory= does not take: its own message, with the close name
        raise_problems("prepare_for_budget", memory_problems(memory, task, allow_approximate, margin))


def model_problems(model: Any) -> list[Problem]:
    if not isinstance(model, nn.Module):
        return [Problem("model", MISSING, f"is a {type(model).__name__} ({shown(model)}), not a model",
                        MODEL_FIX)]
    inner = patches.base_model(model)
    if not isinstance(getattr(inner, "config", None), PretrainedConfig):
        return [Problem("model", MISSING, f"is a {type(inner).__name__}, a torch module without a "
                        "transformers config (memtrain reads the architecture from it)", MODEL_FIX)]
    return []


def memory_problems(memory: dict[str, Any], task: str, allow_approximate: bool, margin: float
                    ) -> list[Problem]:
    """What the recipe's memory section says of ``memory=``'s values, beside what the plugin plans.

    The values are checked as the planner will get them: every field the plugin chooses ``auto``
    and ``memory=`` on top (a chunk size with the loss planned is fine; one with the loss fixed
    ``standard`` is not), with the model's task (the chunked loss is for causal LMs).
    """
    values = {**planned_fields(memory, False, margin, False), "memory.allow_approximate": allow_approximate}
    section: dict[str, Any] = {}
    for path, value in values.items():
        if path.startswith("memory."):
            *parents, leaf = path.removeprefix("memory.").split(".")
            node = section
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    try:
        load_recipe({"model": {"name": "unused", "task": task}, "memory": section}, require=())
    except RecipeError as err:
        found = [p for p in err.problems if p.path.startswith("memory.")]
    else:
        return []
    deepest = [p for p in found if not any(q.path.startswith(p.path + ".") for q in found)]
    return [_in_plugin_words(p, memory_fields(memory)) for p in deepest]


def _in_plugin_words(problem: Problem, fields: dict[str, Any]) -> Problem:
    """A recipe problem of ``memory.…`` as one of ``memory=`` (or of ``margin=`` or
    ``allow_approximate=``), its fix in Python's words."""
    message, fix = _python_words(problem.message), _python_words(problem.fix)
    if problem.path in OWN_ARGUMENTS:
        name = OWN_ARGUMENTS[problem.path].removesuffix("=")
        return Problem(f"{name}={shown(problem.value)}", MISSING, message, fix)
    for path, value in fields.items():
        if problem.path == path or problem.path.startswith(path + "."):
            key = path.removeprefix("memory.")
            rest = problem.path.removeprefix(path).removeprefix(".")
            return Problem(f"memory={{{key!r}: {shown(value)}}}", problem.value if rest else MISSING,
                           f"its `{rest}` {message}" if rest else message, fix)
    key = problem.path.removeprefix("memory.")  # a field the plugin plans, in conflict with memory=
    return Problem(f"memory={shown(dict(fields_as_keys(fields)))}", MISSING,
                   f"conflicts with `{key}`, which prepare_for_budget plans: {message}", fix)


def fields_as_keys(fields: dict[str, Any]) -> dict[str, Any]:
    return {path.removeprefix("memory."): value for path, value in fields.items()}


_RECIPE_SETTING = re.compile(r"`memory\.([\w.]+)(?:: ([^`]+))?`")


def _python_words(text: str) -> str:
    """A recipe's fix (``memory.loss: chunked``, YAML's true/false/null) as memory= writes it."""
    def setting(match: re.Match[str]) -> str:
        key, value = match.group(1), match.group(2)
        if value is None:
            return f"`memory={{{key!r}: ...}}`"
        with contextlib.suppress(yaml.YAMLError):
            value = repr(yaml.safe_load(value))
        return f"`memory={{{key!r}: {value}}}`"
    text = _RECIPE_SETTING.sub(setting, text)
    for yaml_word, python in (("true", "True"), ("false", "False"), ("null", "None")):
        text = re.sub(rf"\b{yaml_word}\b", python, text)
    return text


# ---------------------------------------------------------------------------- attach


def check_attach(trainer: Any, budget: Any, options: dict[str, Any], callback: Any) -> None:
    """``attach``'s arguments: a Trainer, and the options ``callback`` (the callback class) takes.

    Raises:
        MemtrainError: every problem found, each naming its argument, its value and the fix.
    """
    problems: list[Problem] = []
    if not isinstance(trainer, Trainer):
        problems.append(Problem("trainer", MISSING, f"is a {type(trainer).__name__} ({shown(trainer)}), "
                                "not a Trainer", "memtrain.attach(trainer) with the transformers Trainer "
                                "(or TRL trainer) you built, before trainer.train()."))
    takes = [n for n in inspect.signature(callback).parameters if n != "budget"]
    for name in options:
        if name not in takes:
            hint = did_you_mean(name, takes, {}, "")
            problems.append(Problem(f"{name}=", MISSING, "is not an option of attach",
                                    f"{hint}attach takes trainer, budget= and {', '.join(takes)}."))
    known = {k: v for k, v in options.items() if k in takes}
    problems += callback_problems(budget, **known)
    raise_problems("attach", problems)


def check_callback(who: str, budget: Any, **options: Any) -> None:
    """``MemoryBudgetCallback``'s arguments (``who``: the call the user made).

    Raises:
        MemtrainError: every problem found, each naming its argument, its value and the fix.
    """
    raise_problems(who, callback_problems(budget, **options))


def callback_problems(budget: Any = None, *, margin: Any = 0.1, predicted: Any = None,
                      simulate: Any = False, simulate_budget: Any = None, recover: Any = True,
                      every: Any = None, estimate: Any = "auto") -> list[Problem]:
    problems: list[Problem] = []
    if budget is not None and not isinstance(budget, BudgetPlan):
        problems += size("budget", budget, fix=BUDGET_FIX.removesuffix(".") + ", or leave it out (the plan "
                         "prepare_for_budget left on the model, else measurement only).")
    problems += fraction("margin", margin, "a tenth of the budget kept free; measured peaks above the rest "
                         "are warned about")
    if predicted is not None and not isinstance(predicted, BudgetPlan):
        problems += _predicted(predicted)
    problems += flag("simulate", simulate) + flag("recover", recover)
    if simulate_budget is not None:
        problems += size("simulate_budget", simulate_budget, auto=False,
                         fix="a size like '2GiB' or a number of bytes, or leave it out.")
    if every is not None and not (is_whole(every) and every >= 1):
        problems.append(given("every", every, "must be a whole number of steps, at least 1",
                              "every=1 measures every step; leave it out to measure the steps the Trainer "
                              "logs (logging_steps)."))
    if estimate not in (True, False, "auto") or not isinstance(estimate, bool | str):
        problems.append(given("estimate", estimate, "must be True, False or 'auto'",
                              "estimate='auto' (the default: trace the step of a Trainer that computes its "
                              "own loss), True (always) or False (never)."))
    return problems


def _predicted(value: Any) -> list[Problem]:
    try:
        ok = not isinstance(value, bool) and (is_number(value) or isinstance(value, str)) and (
            parse_size(int(value) if is_number(value) else value) > 0)
    except ValueError:
        ok = False
    fix = "the predicted peak as a size like '20GiB' or a number of bytes (e.g. from `memtrain estimate`)."
    return [] if ok else [given("predicted", value, "must be a size of more than 0 bytes", fix)]
