"""Property tests: any recipe the schema could be given, any override string, any option value:
a RunConfig or a MemtrainError, never another exception. 2,000 examples in-process.

The strategies are built from the schema itself (every section, field and type, plus values of
the wrong type), so a new field is covered without touching this file.
"""

from __future__ import annotations

import contextlib
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from conftest import MINILM, TINY_CONFIGS, merge
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from memtrain.config import dump_recipe, load_recipe
from memtrain.config.loader import _flatten, section_model
from memtrain.config.schema import RunConfig
from memtrain.errors import MemtrainError

BASE = {"model": {"from_config": dict(TINY_CONFIGS["llama"]), "tokenizer": MINILM},
        "data": {"source": "builtin:shakespeare-text"}}
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(),
                 st.text(max_size=8), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
SETTINGS = settings(max_examples=700, deadline=None, suppress_health_check=list(HealthCheck))


def for_type(annotation: Any) -> st.SearchStrategy:
    """Values of each member of a field's type, and junk of any other type."""
    choices: list[st.SearchStrategy] = [JUNK]
    for arg in _flatten(annotation):
        origin = typing.get_origin(arg)
        if origin is Literal:
            choices.append(st.sampled_from(typing.get_args(arg)))
        elif isinstance(arg, type) and issubclass(arg, BaseModel):
            choices.append(for_model(arg))
        elif origin is list and section_model(arg) is not None:  # data.mix
            choices.append(st.lists(for_model(section_model(arg)), max_size=2))
        elif origin is list:
            choices.append(st.lists(st.text(max_size=6), max_size=3))
        elif arg is bool:
            choices.append(st.booleans())
        elif arg is int:
            choices.append(st.integers(-3, 5000))
        elif arg is float:
            choices.append(st.floats(-1, 1e4) | st.sampled_from([float("nan"), float("inf")]))
        elif arg is str:
            choices.append(st.text(max_size=10) | st.sampled_from(["auto", "24GiB", "-1GiB", "0B", "no"]))
    return st.one_of(choices)


def for_model(model: type[BaseModel]) -> st.SearchStrategy:
    fields = {name: for_type(field.annotation) for name, field in model.model_fields.items()
              if not (model is RunConfig and name in ("model", "data"))}
    return st.fixed_dictionaries({}, optional={**fields, "not_a_field": JUNK})


FIELDS = [f"{section}.{name}" for section, field in RunConfig.model_fields.items()
          if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
          for name in field.annotation.model_fields]
PATHS = st.sampled_from([*FIELDS, "memory.offload.activations", "memory.randomized_linear.ratio",
                         "model.from_config.hidden_size", "training", "x.y", "training.lr.x"])
RAW = st.one_of(st.text(max_size=12), st.sampled_from(["no", "yes", "true", "null", "[1, 2]", "{a: 1}",
                                                       "1e-4", "-1", "0", "auto", "2GiB", "'", ": :"]))
OVERRIDE = st.one_of(st.builds(lambda k, v: f"{k}={v}", PATHS, RAW), st.text(max_size=20))


def load_or_refuse(recipe: dict, overrides: list[str]) -> None:
    try:
        cfg = load_recipe(recipe, overrides)
    except MemtrainError as err:
        assert str(err)
        return
    dump_recipe(cfg)  # a valid recipe can be written back


@SETTINGS
@given(for_model(RunConfig))
def test_any_recipe_the_schema_could_be_given(sections: dict) -> None:
    load_or_refuse(merge(BASE, sections), [])


@SETTINGS
@given(st.lists(OVERRIDE, max_size=4))
@example(["model.name=~0"])  # a user with no home here: expanduser raised RuntimeError (found here)
def test_any_override_string(overrides: list[str]) -> None:
    load_or_refuse(BASE, overrides)


def test_a_home_of_a_user_this_machine_lacks_is_a_path_that_does_not_exist(tmp_path) -> None:
    from memtrain import sources

    assert sources.expanded("~0/x.jsonl") == Path("~0/x.jsonl")
    assert sources.expanded("~/x") == Path.home() / "x"
    with pytest.raises(FileNotFoundError, match="no such file or directory: ~0"):
        sources.resolve("~0")


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(max_size=12) | st.sampled_from(["24GiB", "auto", "-1GiB", "0", "1e400GiB", "nanGiB"]),
       st.text(max_size=8) | st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:x", "tpu"]))
def test_any_budget_and_device_option(budget: str, device: str) -> None:
    from memtrain.cli.estimate import _check_budget, _check_device

    for check, value in ((_check_budget, budget), (_check_device, device)):
        with contextlib.suppress(MemtrainError):  # anything else fails the test
            check(value)
