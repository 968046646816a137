"""``training.objective: grpo`` end to end: recipes/tiny-llama-grpo.yaml trains through TRL's
GRPOTrainer, both rewards score its completions and the adapter moves; bad GRPO input exits 2 naming
the field."""

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
def test_grpo_recipe_trains_its_adapter_from_both_rewards(tmp_path: Path) -> None:
    """Four steps of the shipped recipe: TRL generates, both rewards score every logged step, and
    the GRPO loss moves the adapter (lora_B starts at zero). Not checked: that the reward rises;
    with this random model it does not yet in a short run (issue 38)."""
    from safetensors.torch import load_file

    from memtrain.run.train import train

    cfg = load_recipe(RECIPE, [f"output.dir={tmp_path / 'run'}", "training.max_steps=4"])
    result = train(cfg)
    logs = [e for e in result.log_history if "reward" in e]
    assert len(logs) >= 2, result.log_history  # logging_steps 2 (and the first step)
    for log in logs:
        assert {"rewards/exact_answer/mean", "rewards/format/mean"} <= log.keys(), log
        assert 0.0 <= log["reward"] <= 2.0 and log["completions/max_length"] <= 4, log
    weights = load_file(tmp_path / "run" / "adapter_model.safetensors")
    lora_b = [t for name, t in weights.items() if "lora_B" in name]
    assert lora_b and min(float(t.norm()) for t in lora_b) > 1e-3, "the adapter did not move"
