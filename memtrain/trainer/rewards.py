"""GRPO's reward functions, named in ``training.grpo_rewards``: built-in verifiable ones and the user's own.

TRL's ``GRPOTrainer`` calls each as ``f(prompts=..., completions=..., completion_ids=...,
**columns)`` (every other data column, one value per completion) and logs its mean under
``rewards/<function name>/mean``. The built-ins are small and verifiable, so nothing here needs a
reward model:

- ``format``: 1.0 if the completion's text matches ``training.grpo_format_pattern``
  (``re.fullmatch``), else 0.0;
- ``exact_answer``: 1.0 if the completion equals the row's ``training.grpo_answer_column``,
  ignoring case, spaces and punctuation (a word-piece tokenizer decodes "Night's" as
  "night ' s"), else 0.0.

``module:function`` is imported from this environment (:func:`resolve`); :func:`check_on_sample`
calls every function once on a real row before the model loads, so a reward that cannot be
imported or raises is a recipe error (exit 2) naming ``training.grpo_rewards``, not a crash at step 1.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memtrain.config import RunConfig
from memtrain.errors import MemtrainError

Reward = Callable[..., list[float]]
FIELD = "training.grpo_rewards"


def text_of(completion: Any) -> str:
    """A completion's text: a string, or (conversational) the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _squash(text: Any) -> str:
    return re.sub(r"[\W_]+", "", str(text).casefold())


def format_reward(pattern: str) -> Reward:
    compiled = re.compile(pattern)

    def format(completions: Sequence[Any], **_: Any) -> list[float]:
        return [1.0 if compiled.fullmatch(text_of(c)) else 0.0 for c in completions]

    return format


def exact_answer_reward(column: str) -> Reward:
    def exact_answer(completions: Sequence[Any], **columns: Any) -> list[float]:
        if column not in columns:
            raise KeyError(f"the data has no column {column!r} (`training.grpo_answer_column`)")
        answers = columns[column]
        return [1.0 if _squash(text_of(c)) == _squash(a) else 0.0
                for c, a in zip(completions, answers, strict=True)]

    return exact_answer


def resolve(cfg: RunConfig) -> list[Reward]:
    """The recipe's reward functions, in order (raises MemtrainError naming the field)."""
    t = cfg.training
    out: list[Reward] = []
    for name in t.grpo_rewards:
        if name == "format":
            try:
                out.append(format_reward(t.grpo_format_pattern))
            except re.error as err:
                raise MemtrainError(f"`training.grpo_format_pattern`: {t.grpo_format_pattern!r} is not a "
                                    f"regular expression ({err}). Fix: write a Python `re` pattern."
                                    ) from None
        elif name == "exact_answer":
            out.append(exact_answer_reward(t.grpo_answer_column))
        else:
            out.append(_import(name))
    return out


def _import(name: str) -> Reward:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise MemtrainError(f"`{FIELD}`: {name!r}: module {module_name!r} cannot be imported "
                            f"({type(err).__name__}: {err}). Fix: install it or put it on PYTHONPATH, or "
                            "correct the name (`package.module:function`).") from None
    func = getattr(module, attr, None)
    if not callable(func):
        raise MemtrainError(f"`{FIELD}`: {name!r}: module {module_name!r} has no function {attr!r}. Fix: "
                            "name a function defined there (`package.module:function`).")
    return func


def check_on_sample(funcs: Sequence[Reward], names: Sequence[str], row: Mapping[str, Any],
                    prompt_key: str, completion: str) -> None:
    """Call every reward once on one real row, as TRL will (one completion): each must return one
    number per completion."""
    prompt = row[prompt_key]
    columns = {k: [v] for k, v in row.items() if k != prompt_key}
    for name, func in zip(names, funcs, strict=True):
        try:
            values = func(prompts=[prompt], completions=[completion], completion_ids=[[]], **columns)
        except Exception as err:
            raise MemtrainError(f"`{FIELD}`: {name!r} raised {type(err).__name__}: {err} when called on the "
                                f"first row with completion {completion!r}, as TRL calls it "
                                "(f(prompts, completions, completion_ids, **columns)). Fix: make it accept "
                                "those arguments (take **kwargs) and return one float per completion."
                                ) from None
        if values is None or len(list(values)) != 1 or not all(v is None or isinstance(v, int | float)
                                                               for v in values):
            raise MemtrainError(f"`{FIELD}`: {name!r} returned {values!r} for one completion. Fix: return a "
                                "list with one float (or None) per completion.")
