"""``training.objective: grpo`` end to end: recipes/tiny-llama-grpo.yaml trains through TRL's
GRPOTrainer and its mean reward rises; bad GRPO input exits 2 naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe, shipped_recipes_dir

RECIPE = shipped_recipes_dir() / "tiny-llama-grpo.yaml"
runner = CliRunner()


def bad_reward(**_: object) -> list[float]:
    raise ValueError("no score for you")


def _validate(*overrides: str) -> str:
    result = runner.invoke(app, ["validate", str(RECIPE), "--data", *overrides])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize(("overrides", "field", "fix"), [
    (["training.grpo_rewards=[]"], "training.grpo_rewards", "name at least one"),
    (["training.grpo_rewards=[no_such_module_x:f]"], "training.grpo_rewards", "cannot be imported"),
    ([f"training.grpo_rewards=[{__name__}:bad_reward]"], "training.grpo_rewards", "no score for you"),
    (["training.grpo_num_generations=5"], "training.grpo_num_generations", "multiple of 5"),
    (["training.grpo_loss=ppo"], "training.grpo_loss", "dapo"),
    (["training.grpo_max_completion_length=220"], "data.max_length", "or less"),
])
def test_bad_grpo_input_exits_2_naming_the_field(overrides: list[str], field: str, fix: str) -> None:
    out = _validate(*overrides)
    assert field in out and fix in out, out


@pytest.mark.slow
def test_grpo_recipe_trains_and_the_reward_rises(tmp_path: Path) -> None:
    from memtrain.run.train import train

    cfg = load_recipe(RECIPE, [f"output.dir={tmp_path / 'run'}"])
    result = train(cfg)
    rewards = [e["reward"] for e in result.log_history if "reward" in e]
    assert len(rewards) >= 8, result.log_history
    start, end = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4  # smoothed over four logs each
    assert end > start + 0.1, rewards
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()
