"""The table `memtrain train` prints before it starts says where the optimizer's state and step are."""

from __future__ import annotations

import pytest

from memtrain.config import load_recipe
from memtrain.run.train import optimizer_line


@pytest.mark.parametrize(("overrides", "said"), [
    ([], "adamw, lr 0.001 (linear), 1 epoch(s)"),
    (["memory.offload.optimizer=true"], "adamw, lr 0.001 (linear), 1 epoch(s), state and step on the host "
                                        "(memory.offload.optimizer)"),
    (["training.optimizer_in_backward=true", "training.max_grad_norm=null", "training.max_steps=30"],
     "adamw, lr 0.001 (linear), 30 steps, stepped inside backward (training.optimizer_in_backward)"),
])
def test_the_optimizer_row_names_the_techniques_that_move_its_state_or_step(overrides: list[str],
                                                                           said: str) -> None:
    assert optimizer_line(load_recipe("recipes/quickstart.yaml", overrides)) == said
