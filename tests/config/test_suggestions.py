"""Unknown keys get "did you mean" for the names other tools use, and sizes without a unit get one;
each suggested fix, applied, loads (issue 35)."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from conftest import causal_recipe
from pydantic import BaseModel, ValidationError
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import RecipeError, load_recipe
from memtrain.config.loader import section_model
from memtrain.config.schema import RunConfig
from memtrain.config.suggest import ALIASES, SIZE_FIELDS

runner = CliRunner()


@pytest.fixture
def base(tmp_path: Path) -> dict:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a b c"}\n')
    return causal_recipe(tmp_path, data)


def sections() -> dict[str, type[BaseModel]]:
    return {name: m for name, f in RunConfig.model_fields.items() if (m := section_model(f.annotation))}


def problem_line(recipe: dict, tmp_path: Path, path: str) -> str:
    """`memtrain validate` on the recipe exits 2; the line of the problem at ``path``."""
    file = tmp_path / "r.yaml"
    file.write_text(yaml.safe_dump(recipe))
    result = runner.invoke(app, ["validate", str(file)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.startswith(f"  - `{path}`")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_every_alias_names_a_real_field() -> None:
    fields = {k for m in sections().values() for k in m.model_fields} | set(RunConfig.model_fields)
    assert not {alias: field for alias, field in ALIASES.items() if field not in fields}


@pytest.mark.parametrize(("section", "key", "value", "meant"), [
    ("adapter", "rank", 16, "r"),
    ("adapter", "lora_r", 16, "r"),
    ("adapter", "lora_alpha", 32, "alpha"),
    ("adapter", "lora_dropout", 0.1, "dropout"),
    ("training", "lr", 1e-4, "learning_rate"),
    ("training", "batch_size", 4, "micro_batch_size"),
    ("training", "num_epochs", 2, "epochs"),
    ("training", "gradient_accumulation_steps", 1, "gradient_accumulation"),
    ("data", "seq_len", 64, "max_length"),
    ("data", "sequence_len", 64, "max_length"),
    ("data", "max_seq_length", 64, "max_length"),
    ("model", "torch_dtype", "bf16", "dtype"),
    ("memory", "gradient_checkpointing", "full", "checkpointing"),
    ("output", "output_dir", "elsewhere", "dir"),
    ("adapter", "alpah", 32, "alpha"),  # a typo: difflib
])
def test_unknown_key_names_the_field_and_the_fix_loads(base: dict, tmp_path: Path, section: str, key: str,
                                                       value: object, meant: str) -> None:
    recipe = {**base, section: {**base.get(section, {}), key: value}}
    recipe[section].pop(meant, None)
    line = problem_line(recipe, tmp_path, f"{section}.{key}")
    assert f"Fix: did you mean `{meant}`?" in line, line
    recipe[section][meant] = recipe[section].pop(key)
    assert getattr(getattr(load_recipe(recipe), section), meant) == value


@pytest.mark.parametrize(("section", "key", "value", "home"), [
    ("training", "max_length", 64, "data"),
    ("training", "seq_len", 64, "data"),  # an alias of a key of another section
    ("adapter", "budget", "1GiB", "memory"),
])
def test_a_key_of_another_section_is_sent_there(base: dict, tmp_path: Path, section: str, key: str,
                                                value: object, home: str) -> None:
    recipe = {**base, section: {**base[section], key: value}}
    line = problem_line(recipe, tmp_path, f"{section}.{key}")
    moved = re.search(rf"move it there, as `{home}\.(\w+)`", line)
    assert moved, line
    del recipe[section][key]
    recipe[home] = {**recipe.get(home, {}), moved.group(1): value}
    load_recipe(recipe)


def test_unknown_keys_of_every_section_come_at_once(base: dict, tmp_path: Path) -> None:
    recipe = {**base, "adapter": {"rank": 4}, "training": {**base["training"], "lr": 1e-3},
              "data": {**base["data"], "seq_len": 64}}
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    text = str(err.value)
    assert "3 problems" in text
    for path, meant in (("adapter.rank", "r"), ("training.lr", "learning_rate"),
                        ("data.seq_len", "max_length")):
        assert re.search(rf"`{re.escape(path)}`: unknown key\. Fix: did you mean `{meant}`", text), text


def test_the_size_fields_are_those_that_parse_sizes() -> None:
    """Found independently of suggest.SIZE_FIELDS: the string fields that refuse a non-size."""
    required = {"data": {"source": "d.jsonl"}, "model": {"name": "m"}}

    def refuses(model: type[BaseModel], values: dict, key: str) -> bool:
        try:
            model.model_validate(values, context={"problems": []})
        except ValidationError as err:
            return any(e["loc"][0] == key for e in err.errors())
        return False

    found = set()
    for name, model in sections().items():
        for key, field in model.model_fields.items():
            ann = field.annotation
            union = typing.get_origin(ann) in (typing.Union, types.UnionType)
            kinds = typing.get_args(ann) if union else (ann,)
            if str in kinds and refuses(model, {**required.get(name, {}), key: "many"}, key):
                assert not refuses(model, {**required.get(name, {}), key: "24GiB"}, key)
                found.add(f"{name}.{key}")
    assert found == set(SIZE_FIELDS)


@pytest.mark.parametrize(("path", "value", "fixed"), [
    ("memory.budget", 300, "300MiB"),
    ("memory.host_budget", 64, "64MiB"),
    ("memory.simulate_budget", 1.5, "1.5MiB"),
    ("memory.budget", 24 * 2**30, "24GiB"),  # bytes, most likely
    ("memory.budget", 3 * 2**29, "1.50GiB"),
    ("memory.budget", 0, "24GiB"),
])
def test_a_size_without_a_unit_gets_one(base: dict, tmp_path: Path, path: str, value: object,
                                        fixed: str) -> None:
    section, key = path.split(".")
    recipe = {**base, section: {key: value}}
    line = problem_line(recipe, tmp_path, path)
    assert f"must look like '24GiB', '512MiB' or 'auto', got {value!r}" in line, line
    assert "set it to a string" not in line
    assert re.search(rf"Fix: write (it|a positive size) with its unit,( e\.g\.)? `{key}: {re.escape(fixed)}`",
                     line), line
    recipe[section][key] = fixed
    assert getattr(load_recipe(recipe).memory, key) == fixed
