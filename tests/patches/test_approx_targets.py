"""Approximate-gradient layers find their default targets from the model's structure, so
`memory.allow_approximate: true` plans on every architecture in the catalog."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CATALOG_ENCODERS, MINILM, causal_recipe, tiny_catalog_configs, tiny_catalog_model
from torch import nn

from memtrain import patches
from memtrain.config import FewBitConfig, RandomizedLinearConfig, load_recipe
from memtrain.patches import fewbit, randomized_linear
from memtrain.patches._targets import blocks
from memtrain.plan import costmodel, planner
from memtrain.plan.search import Search

CATALOG = tiny_catalog_configs()


@pytest.fixture(autouse=True)
def _rates(monkeypatch: pytest.MonkeyPatch) -> None:
    # the choice does not matter here, only that planning runs: nominal rates, nothing measured
    nominal = costmodel.Rates("nominal (test)", costmodel.NOMINAL_CUDA_RATES)
    monkeypatch.setattr(costmodel, "rates", lambda device: nominal)


def per_block(model: nn.Module, names: list[str]) -> dict[str, int]:
    return {b: sum(n.startswith(b + ".") for n in names) for b in blocks(model)}


@pytest.mark.parametrize("arch", sorted(CATALOG))
@pytest.mark.parametrize("patch", ["fewbit", "randomized_linear"])
def test_default_targets_patch_every_block_and_train(arch: str, patch: str) -> None:
    model = tiny_catalog_model(arch)
    if patch == "fewbit":
        fewbit.apply(model, FewBitConfig(bits=3))
    else:
        randomized_linear.apply(model, RandomizedLinearConfig(ratio=0.5))
    (record,) = patches.records(model)
    counts = per_block(model, record.modules)
    assert len(counts) == 2 and all(n >= 1 for n in counts.values()), counts
    assert len(set(counts.values())) == 1  # the same modules in every block
    model(input_ids=torch.randint(0, 512, (2, 8))).logits.float().square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("arch", sorted(CATALOG))
def test_allow_approximate_plans_on_every_catalog_architecture(arch: str, tmp_path: Path,
                                                               tiny_text_file: Path) -> None:
    # One layer and full fine-tuning keep the planner's ten fake-tensor traces short.
    recipe = causal_recipe(tmp_path, tiny_text_file, data={"max_length": 16}, adapter={"method": "full"},
                           memory={"allow_approximate": True, "activation_bits": "auto",
                                   "randomized_linear": "auto"})
    config = {**CATALOG[arch], "vocab_size": 30522, "num_hidden_layers": 1, "n_layer": 1}
    if arch == "gpt2":
        config.pop("num_hidden_layers")
    else:
        config.pop("n_layer")
    recipe["model"] = {"from_config": config, "tokenizer": MINILM}
    if arch in CATALOG_ENCODERS:
        recipe["model"]["task"] = "sequence-classification"
        recipe["data"].update(format="classification")
    decided = planner.plan(load_recipe(recipe), "4GiB", device="cpu")
    assert set(decided.chosen.values) == {"memory.activation_bits", "memory.randomized_linear"}
    # every combination was traced with its patches applied, and fits
    combos = [c.values for c in [decided.chosen, *decided.alternatives]]
    assert {(v["memory.activation_bits"], v["memory.randomized_linear"] is not None) for v in combos} == {
        (None, False), (3, False), (None, True), (3, True)}


def test_the_randomized_backward_and_selective_checkpointing_are_never_paired(
        tmp_path: Path, tiny_text_file: Path) -> None:
    """Selective checkpointing caches the sketch of the first forward while the recompute draws the
    layer's next seed: the weight gradient would pair two sketches (mean zero). Refused when fixed,
    with the fix; skipped when planned. The planner reached the pair with `allow_approximate` and
    every plan died in its trace ("Tensor cached during selective activation checkpoint has been
    mutated")."""
    from memtrain.config import RecipeError

    recipe = causal_recipe(tmp_path, tiny_text_file, data={"max_length": 16}, adapter={"method": "full"},
                           memory={"randomized_linear": {"ratio": 0.2}, "checkpointing": "selective"})
    said = r"`memory.randomized_linear`: cannot run under `memory.checkpointing: selective`"
    with pytest.raises(RecipeError, match=said + r".*Fix: use `memory.checkpointing: full`"):
        load_recipe(recipe)
    recipe["memory"]["checkpointing"] = "full"
    load_recipe(recipe)
    recipe["memory"] = {"allow_approximate": True, "randomized_linear": "auto", "checkpointing": "auto"}
    search = Search(load_recipe(recipe), "cpu", 2**30)
    pairs = {(c.values["memory.randomized_linear"] is not None, c.values["memory.checkpointing"])
             for c in search.candidates()}
    assert {(True, "full"), (False, "selective")} <= pairs and (True, "selective") not in pairs
