"""The model's position limit for every family (issue 35 part 3): learned tables, RoPE's
``max_position_embeddings`` and RoPE scaling; ``model.config_overrides`` raises it; ``validate``,
``data.max_length: auto`` and training respect it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import MINILM, TINY_CONFIGS, causal_recipe
from transformers import AutoConfig
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import RecipeError, load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator.setup import position_limit, resolve_config
from memtrain.model import build_config

# 256 positions, as in the trial: Qwen2 from the shared tiny configs, Qwen3 shaped alike
QWEN3 = {**TINY_CONFIGS["qwen2"], "model_type": "qwen3", "head_dim": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # 32 x 64 = 2,048 would be past the 256 positions
runner = CliRunner()


def _config(values: dict[str, Any]) -> Any:
    values = copy.deepcopy(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


@pytest.mark.parametrize(("values", "limit"), [
    (TINY_CONFIGS["qwen2"], 256),
    (QWEN3, 256),
    (TINY_CONFIGS["llama"], 256),
    (TINY_CONFIGS["mistral"], 256),
    (TINY_CONFIGS["gpt2"], 256),  # learned table (n_positions)
    (TINY_CONFIGS["roberta"], 257),  # 258 less the padding offset (pad 0 + 1)
    ({**TINY_CONFIGS["qwen2"], "rope_scaling": YARN}, 1024),  # YaRN: 4 x 256
    ({**TINY_CONFIGS["qwen2"], "max_position_embeddings": 2048, "rope_scaling": YARN}, 2048),  # the larger
    # Llama 3's own scaling stretches low frequencies only: its max_position_embeddings is the limit
    ({**TINY_CONFIGS["llama"], "rope_scaling": LLAMA3}, 256),
])
def test_every_family_has_its_position_limit(values: dict[str, Any], limit: int) -> None:
    assert position_limit(_config(values)) == limit


def _recipe_file(tmp_path: Path, corpus: Path, model: dict[str, Any], **data: Any) -> Path:
    recipe = causal_recipe(tmp_path, corpus, data=data,
                           training={"micro_batch_size": 1, "gradient_accumulation": 1})
    recipe["model"] = {"from_config": copy.deepcopy(model), "tokenizer": MINILM}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.mark.parametrize("model", [TINY_CONFIGS["qwen2"], QWEN3], ids=["qwen2", "qwen3"])
def test_validate_refuses_a_length_beyond_the_positions_naming_the_field_and_the_fix(
        tmp_path: Path, tiny_text_file: Path, model: dict[str, Any]) -> None:
    path = _recipe_file(tmp_path, tiny_text_file, model, max_length=1024)
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "`data.max_length`: 1,024 tokens exceed the 256 positions this model" in said
    assert "set `data.max_length` to 256 or less" in said and "`model.config_overrides`" in said
    assert "Traceback" not in said
    assert runner.invoke(app, ["validate", str(path), "data.max_length=256"]).exit_code == 0
    # the fix the message names works: YaRN 4 x 256 = 1,024 positions
    extended = runner.invoke(app, ["validate", str(path), "model.config_overrides={rope_scaling: "
                                   "{rope_type: yarn, factor: 4, original_max_position_embeddings: 256}}"])
    assert extended.exit_code == 0, extended.output


def test_plan_with_length_auto_never_proposes_beyond_the_positions(tmp_path: Path,
                                                                   tiny_text_file: Path) -> None:
    """The trial: 13,056 tokens for a 256-position Qwen3, 9,728 for a Qwen2, at 2 GiB."""
    path = _recipe_file(tmp_path, tiny_text_file, QWEN3, max_length="auto")
    result = runner.invoke(app, ["plan", str(path), "--budget", "2GiB", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["settings"]["data.max_length"] == 256
    assert found["max_length"]["position_limit"] == 256
    assert "the model's 256 positions" in found["max_length"]["why"]


def test_config_overrides_reach_the_real_config_and_the_estimators(tmp_path: Path,
                                                                   tiny_text_file: Path) -> None:
    from memtrain.model import load_model

    recipe = causal_recipe(tmp_path, tiny_text_file, "qwen2",
                           model={"config_overrides": {"rope_scaling": YARN, "max_position_embeddings": 512}})
    cfg = load_recipe(recipe)
    fake, _ = resolve_config(cfg.model)
    real = load_model(cfg.model).config
    for config in (fake, build_config(cfg.model), real):
        assert config.max_position_embeddings == 512
        rope = config.rope_parameters
        assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
        assert rope["rope_theta"] == 10000.0  # merged into the model's own RoPE settings
        assert position_limit(config) == 1024


def test_a_catalog_model_is_extended_past_its_positions_only_by_config_overrides() -> None:
    """Llama-3.1-8B has 131,072 positions; the long-context benchmark plans past them with YaRN."""
    base = {"model": {"name": "meta-llama/Llama-3.1-8B"}, "data": {"source": "builtin:shakespeare-text"}}
    cfg = load_recipe(base)
    assert position_limit(resolve_config(cfg.model)[0]) == 131072
    yarn = {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 131072}
    cfg = load_recipe({**base, "model": {**base["model"], "config_overrides": {"rope_scaling": yarn}}})
    config = resolve_config(cfg.model)[0]
    assert position_limit(config) == 1048576 and config.rope_parameters["rope_theta"] == 500000.0
    assert "low_freq_factor" not in config.rope_parameters  # a new rope_type keeps only rope_theta


def test_a_misspelt_override_is_refused_with_the_key_it_meant(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, "qwen2",
                                    model={"config_overrides": {"max_position_embedding": 512}}))
    with pytest.raises(RecipeError, match=r"`model.config_overrides.max_position_embedding`: is not a "
                                          r"setting of this model's config \(qwen2\).*did you mean "
                                          r"`max_position_embeddings`"):
        resolve_config(cfg.model)


def test_train_refuses_a_length_beyond_the_positions_before_reading_the_data(
        tmp_path: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.run import train as run_train

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was read before the length was checked")

    monkeypatch.setattr(run_train, "prepare_data", no_data)
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, "qwen2", data={"max_length": 300}))
    with pytest.raises(MemtrainError, match=r"`data.max_length`: 300 tokens exceed the 256 positions"):
        run_train.train(cfg)
