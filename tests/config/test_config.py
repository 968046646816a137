"""Recipe schema and loader: defaults, overrides, every error at once with its field path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import causal_recipe

from memtrain.config import RecipeError, dump_recipe, load_recipe
from memtrain.config.batch import Batch, resolve_batch
from memtrain.units import format_bytes, parse_size


def recipe(tmp_path: Path, **sections) -> dict:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    return causal_recipe(tmp_path, data, **sections)


def problems(data: dict, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(data, overrides or [])
    return [str(p) for p in info.value.problems]


def test_minimal_recipe_fills_defaults(tmp_path: Path) -> None:
    cfg = load_recipe(recipe(tmp_path))
    assert cfg.training.optimizer == "adamw"
    assert cfg.memory.checkpointing == "none"
    assert cfg.adapter.target_modules == "all-linear"
    again = load_recipe(yaml.safe_load(dump_recipe(cfg)))
    assert again == cfg  # the dumped recipe is complete and reloads to the same config


def test_overrides_parse_yaml_values(tmp_path: Path) -> None:
    cfg = load_recipe(recipe(tmp_path), ["training.learning_rate=1e-4", "memory.checkpointing=2",
                                         "adapter.target_modules=[q_proj, v_proj]",
                                         "memory.randomized_linear.ratio=0.3"])
    assert cfg.training.learning_rate == 1e-4
    assert cfg.memory.checkpointing == 2
    assert cfg.adapter.target_modules == ["q_proj", "v_proj"]
    assert cfg.memory.randomized_linear is not None and cfg.memory.randomized_linear.ratio == 0.3


def test_margin_auto_is_zero_only_against_a_simulated_budget(tmp_path: Path) -> None:
    margin = lambda *o: load_recipe(recipe(tmp_path), list(o)).memory.margin_fraction  # noqa: E731
    assert margin() == 0.1
    assert margin("memory.budget=2GiB") == 0.1
    assert margin("memory.simulate_budget=1GiB") == 0.0  # exact: it counts what the estimate predicts
    assert margin("memory.simulate_budget=1GiB", "memory.budget=2GiB") == 0.0  # the budget read
    assert margin("memory.simulate_budget=1GiB", "memory.margin=0.2") == 0.2
    found = problems(recipe(tmp_path), ["memory.margin=1.5"])
    assert any("`memory.margin`" in p and "1.5" in p for p in found)


def test_the_planner_the_probe_and_the_fixes_read_one_budget(tmp_path: Path) -> None:
    """With both budgets set, the plan is for the one the run is held to (the simulated one), the
    auto-fit probe checks that one, and a fix names it: one rule (MemoryConfig.budget_setting)."""
    from memtrain.plan.autofit import budget_limit
    from memtrain.plan.planner import budget_bytes

    cfg = load_recipe(recipe(tmp_path), ["memory.simulate_budget=1GiB", "memory.budget=2GiB"])
    assert budget_bytes(cfg) == budget_limit(cfg) == 2**30
    assert cfg.memory.budget_field == "memory.simulate_budget"
    cfg = load_recipe(recipe(tmp_path), ["memory.budget=2GiB"])
    assert budget_bytes(cfg) == 2 * 2**30 and budget_limit(cfg) == int(0.9 * 2 * 2**30)
    assert cfg.memory.budget_field == "memory.budget"


def test_a_simulated_budget_larger_than_the_budget_is_a_recipe_problem(tmp_path: Path) -> None:
    """The simulated budget is read in place of `memory.budget` (above): one larger than the
    device's would plan a run the device cannot hold, so it is refused, naming both."""
    found = problems(recipe(tmp_path), ["memory.simulate_budget=4GiB", "memory.budget=2GiB"])
    assert len(found) == 1 and "`memory.simulate_budget`" in found[0], found
    assert "4GiB" in found[0] and "2.00 GiB" in found[0] and "at most `2GiB`" in found[0], found
    load_recipe(recipe(tmp_path), ["memory.simulate_budget=2GiB", "memory.budget=2GiB"])  # equal: fine
    load_recipe(recipe(tmp_path), ["memory.simulate_budget=4GiB", "memory.budget=auto"])  # unknown until run


def test_all_errors_reported_at_once(tmp_path: Path) -> None:
    found = problems(recipe(tmp_path), [
        "training.lerning_rate=1",          # unknown key
        "training.epochs=many",             # wrong type
        "data.max_length=0",                # out of range
        "training.optimizer=adam",          # not an option
        "memory.budget=24 gigs",            # bad size
        "model.quantization=nf4",           # ...with full fine-tuning below
        "adapter.method=full",
    ])
    joined = "\n".join(found)
    assert len(found) == 6, joined
    assert "`training.lerning_rate`: unknown key" in joined and "did you mean `learning_rate`" in joined
    assert "`training.epochs`: expected a number, got 'many'" in joined
    assert "`data.max_length`: must be greater than 0, got 0" in joined
    assert "`training.optimizer`" in joined and "did you mean 'adamw'" in joined
    assert "`memory.budget`" in joined and "24GiB" in joined
    assert "`adapter.method`" in joined and "QLoRA" in joined


def test_a_batch_size_below_one_is_reported_beside_another_problem_of_its_section(tmp_path: Path) -> None:
    """The range check of a batch field is the field's own, so a wrong type elsewhere in
    `training` does not hide it (as a check of the whole section it ran only once every field of
    the section was valid: an outside user's `validate` listed one problem of three)."""
    found = problems(recipe(tmp_path), ["training.micro_batch_size=-2", "training.learning_rate=fast",
                                        "training.gradient_accumulation=0"])
    joined = "\n".join(found)
    assert len(found) == 3, joined
    assert "`training.micro_batch_size`: must be a positive integer or `auto`, got -2" in joined
    assert "`training.gradient_accumulation`: must be a positive integer or `auto`, got 0" in joined
    assert "`training.learning_rate`: expected a number, got 'fast'" in joined


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_an_8bit_optimizer_cannot_be_offloaded_and_the_planner_skips_the_pair(
        optimizer: str, tmp_path: Path) -> None:
    """bitsandbytes' optimizers keep their own state: offloading one failed only when the optimizer
    was built, after `validate` said ok, and a plan with both fields `auto` stopped on it (an
    outside user's `plan ... training.optimizer=auto memory.offload.optimizer=auto`). Planted: the
    check removed -> both parts fail."""
    from memtrain.plan import planner

    found = problems(recipe(tmp_path, adapter={"method": "full"}),
                     [f"training.optimizer={optimizer}", "memory.offload.optimizer=true"])
    assert len(found) == 1 and "`memory.offload.optimizer`" in found[0] and optimizer in found[0], found
    cfg = load_recipe(recipe(tmp_path, adapter={"method": "full"}),
                      ["training.optimizer=auto", "memory.offload.optimizer=auto"])
    pairs = {(c.values["training.optimizer"], c.values["memory.offload.optimizer"])
             for c in planner.Search(cfg, "cuda", 2**30).candidates()}
    assert (optimizer, True) not in pairs and ("adamw_8bit", False) in pairs and ("adamw", True) in pairs


def test_inconsistent_batch_sizes(tmp_path: Path) -> None:
    found = problems(recipe(tmp_path, training={"effective_batch_size": 30, "micro_batch_size": 4,
                                                "gradient_accumulation": 2}))
    assert len(found) == 1 and "`training.effective_batch_size`" in found[0] and "4 × 2 × 1 = 8" in found[0]
    found = problems(recipe(tmp_path, training={"effective_batch_size": 30, "micro_batch_size": 4,
                                                "gradient_accumulation": None}))
    assert "not a multiple of micro_batch_size × processes = 4" in found[0]


@pytest.mark.parametrize(("given", "expected"), [
    ({"effective_batch_size": 32, "micro_batch_size": 4}, Batch(4, 8)),
    ({"effective_batch_size": 32, "gradient_accumulation": 4}, Batch(8, 4)),
    ({"micro_batch_size": 4, "gradient_accumulation": 3}, Batch(4, 3)),
    ({"effective_batch_size": 16}, Batch(16, 1)),
])
def test_batch_derivation(tmp_path: Path, given: dict, expected: Batch) -> None:
    base = {"micro_batch_size": None, "gradient_accumulation": None}
    cfg = load_recipe(recipe(tmp_path, training={**base, **given}))
    assert resolve_batch(cfg.training) == expected
    assert resolve_batch(cfg.training).effective == given.get("effective_batch_size", expected.effective)


def test_missing_files_and_sources(tmp_path: Path) -> None:
    found = problems(recipe(tmp_path), ["data.source=./nope.jsonl", "model.tokenizer=pkg:no_such_pkg/x"])
    assert any("`data.source`" in p and "nope.jsonl" in p for p in found)
    assert any("`model.tokenizer`" in p and "no_such_pkg" in p for p in found)
    found = problems(recipe(tmp_path), ["data.source=builtin:milton"])
    assert "builtin:shakespeare-spelling" in found[0]


def test_bad_overrides_and_yaml(tmp_path: Path) -> None:
    assert "section.key=value" in problems(recipe(tmp_path), ["learning_rate"])[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: x\n bad-indent: [")
    with pytest.raises(RecipeError, match="not valid YAML at line"):
        load_recipe(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must be a mapping"):
        load_recipe(listed)


def test_output_dir_template(tmp_path: Path) -> None:
    r = recipe(tmp_path)
    r["output"]["dir"] = "runs/{recipe}"
    path = tmp_path / "my-run.yaml"
    path.write_text(yaml.safe_dump(r))
    assert load_recipe(path).output.dir == "runs/my-run"


def test_sizes() -> None:
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(512) == 512
    with pytest.raises(ValueError, match="24GiB"):
        parse_size("24 gigs")
    assert format_bytes(3 * 2**30) == "3.00 GiB"


@pytest.mark.parametrize("field", ["memory.budget", "memory.host_budget", "memory.simulate_budget"])
def test_a_budget_without_its_unit_is_refused_naming_the_fix(field: str, tmp_path: Path,
                                                               tiny_text_file: Path) -> None:
    """`budget: 300` is 300 bytes, surely 300GiB or 300MiB meant: refused, naming the field, the value
    and the fix; a number of bytes from 1 MiB on is taken as written."""
    recipe = causal_recipe(tmp_path, tiny_text_file)
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, [f"{field}='300'"])  # quoted: a string, as `budget: "300"` is
    assert f"`{field}`" in str(err.value) and "300GiB" in str(err.value), str(err.value)
    assert load_recipe(recipe, [f"{field}='{2**20}'"])


def test_recipe_reference_is_generated_from_the_schema() -> None:
    from scripts.tools.gen_docs import recipes_md  # the schema's tables and the registry's techniques

    committed = (Path(__file__).parents[2] / "docs" / "RECIPES.md").read_text(encoding="utf-8")
    assert committed == recipes_md(), "run `python -m scripts.tools.gen_docs` and commit docs/RECIPES.md"
