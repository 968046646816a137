"""The registry of techniques (issue 36): one registration carries every fact the library needs,
and what was kept by hand is derived from it. The "add a technique" checklist, as tests: every
registered patch has its module's ``Config`` and ``apply``, its own test module, a case in the
independent count of the real step, an ``auto`` refused the same way, and a row in the generated
tables."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from memtrain import patches
from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator.setup import NEEDS_VALUE, recipe_value
from memtrain.patches import Knob, ModelShape, Pass, fixed
from memtrain.plan import search, space

ROOT = Path(__file__).parents[2]
PATCHES = [t for t in patches.techniques() if t.hook is not None]
# test modules named before the registry used module names
TEST_MODULES = {"activation_offload": "test_offload.py", "lora": "test_lora_targets.py"}


def recipe(values: dict[str, Any] | None = None) -> Any:
    return space.with_values(load_recipe(ROOT / "recipes" / "tiny-llama-shakespeare.yaml"), values or {})


@pytest.mark.parametrize("technique", PATCHES, ids=lambda t: t.name)
def test_every_patch_is_registered_by_its_module_name_with_config_apply_and_tests(technique: Any) -> None:
    module = inspect.getmodule(technique.hook)
    assert module is not None and module.__name__ == f"memtrain.patches.{technique.name}"
    assert technique.config is module.Config and technique.apply is module.apply
    model, config = list(inspect.signature(module.apply).parameters)[:2]
    assert (model, config) in {("model", "config"), ("model", "cfg")}
    assert technique.knobs, f"{technique.name}: the planner cannot choose it (no knob registered)"
    assert technique.doc is not None, f"{technique.name}: no row in the README's table of techniques"
    tests = TEST_MODULES.get(technique.name, f"test_{technique.name}.py")
    assert (ROOT / "tests" / "patches" / tests).exists(), \
        f"{technique.name}: no tests/patches/test_{technique.name}.py (equivalence, effect, failure paths)"


def test_every_patch_has_a_case_in_the_independent_count_of_the_real_step(tmp_path: Path) -> None:
    from tests.end_to_end.test_independent_count import CASES, recipe_for

    covered: set[str] = set()
    for name, case in CASES.items():
        (tmp_path / name).mkdir()
        cfg = recipe_for(case, tmp_path / name)
        covered |= {t.name for t in PATCHES for k in t.knobs
                    if recipe_value(cfg, k.path) not in (k.off, "auto")}
    missing = [t.name for t in PATCHES if t.name not in covered]
    assert not missing, f"add a case to tests/end_to_end/test_independent_count.py::CASES for {missing}"


@pytest.mark.parametrize("path", [k.path for t in PATCHES for k in t.knobs if k.plannable])
def test_an_auto_that_reaches_a_patch_is_refused_the_same_way_by_every_patch(path: str) -> None:
    technique = next(t for t in PATCHES if any(k.path == path for k in t.knobs))
    first = technique.knobs[0]
    on = {first.path: space.options(recipe({"memory.allow_approximate": True}), first.path,
                                    ModelShape(4, 64, 512))[-1]} if first.path != path else {}
    cfg = recipe({"memory.allow_approximate": True, **on, path: "auto"})
    with pytest.raises(MemtrainError, match=rf"`{path}` is `auto`: run the planner first"):
        technique.hook(nn.Linear(2, 2), cfg)


def test_old_patch_names_still_work() -> None:
    assert patches.recipe_field("offload") == patches.recipe_field("activation_offload") == "memory.offload"
    assert patches.get("offload_embeddings") is patches.get("embedding_offload")
    assert patches.apply_patches(nn.Linear(2, 2), recipe(), only=["offload"]) is not None


def test_a_registration_under_another_name_than_its_module_is_refused() -> None:
    def hook(model: nn.Module, cfg: Any) -> None:
        return None

    hook.__module__ = "memtrain.patches.tiled_mlp"
    with pytest.raises(ValueError, match="name it 'tiled_mlp'"):
        patches.register("tiles", patches.TILING, "memory.tiled_mlp")(hook)
    with pytest.raises(ValueError, match="already registered"):
        knob = Knob("memory.lean_norm", fixed(False), False, order=1)
        patches.register_setting("another", "memory.lean_norm", (knob,))


def test_every_knobs_options_are_in_memory_order() -> None:
    shape = ModelShape(depth=4, hidden=1024, vocab=32000)
    for cfg in (recipe({"memory.allow_approximate": True}), recipe({"distributed.processes": 2})):
        for k in patches.knobs():
            ranks = [sum(k.rank_of(v, shape)) for v in k.options(cfg, shape)]
            assert ranks == sorted(ranks), (k.path, k.options(cfg, shape), ranks)


def test_the_planner_lists_are_derived_from_the_registry() -> None:
    knobs = patches.knobs()
    assert tuple(k.path for k in knobs if k.needs_value) == NEEDS_VALUE
    assert set(search.PATCHED_FIELDS) == {k.path for k in knobs if k.patches_model}
    # the two fields a hand-kept list left out (issue 36)
    assert {"memory.tiled_mlp", "memory.lean_norm"} <= set(search.PATCHED_FIELDS)
    plain = space.plain([k.path for k in knobs])
    assert plain == {k.path: k.off for k in knobs if not k.base}
    assert "model.quantization" not in plain and plain["memory.checkpointing"] == "none"


def test_each_cost_hook_adds_known_terms_and_nothing_when_off() -> None:
    """A technique's step-time cost lives in its module (``Knob.cost``): each hook returns only
    the cost model's terms, none negative, nothing with its technique off (the plain trace's cost
    is the trace's own), and more with it on where it has a cost. Planted: the embedding offload's
    hook returning its rows with the table on the device -> fails."""
    costed = [k for k in patches.knobs() if k.cost is not None]
    assert {k.path for k in costed} >= {"memory.checkpointing", "memory.tiled_mlp", "model.quantization",
                                        "memory.offload.embeddings", "memory.offload.optimizer"}
    shape = ModelShape(depth=4, hidden=1024, vocab=32000)
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256))
    for traced in (None, recipe()):  # the candidate's own trace, then a lower bound's plain one
        for k in costed:
            for value in {k.off, *k.options(recipe(), shape)}:
                cfg = recipe({"adapter.method": "lora", "model.quantization": "nf4", k.path: value})
                inputs = patches.CostInputs(cfg, shape, 2, 10**9, 10**7, lambda: model,
                                            Pass(1e12, 900, 10**9), Pass(1e9, 600, 10**8), traced)
                terms = k.cost(inputs, value)
                assert set(terms) <= set(patches.COST_TERMS), (k.path, terms)
                assert all(v >= 0 for v in terms.values()), (k.path, value, terms)
                if value == k.off:
                    assert not any(terms.values()), (k.path, value, terms)
                elif value in (True, "full", "nf4"):
                    assert any(terms.values()), (k.path, value, terms)


def test_readme_table_of_techniques_is_generated_from_the_registry() -> None:
    from scripts.tools.gen_docs import readme_md

    committed = (ROOT / "README.md").read_text(encoding="utf-8")
    assert committed == readme_md(committed), "run `python -m scripts.tools.gen_docs` and commit README.md"
    for t in patches.techniques():
        if t.doc is not None:
            assert f"| {t.doc.title} |" in committed


def _field(path: str) -> Any:
    """The recipe schema's pydantic field at a dotted path (``memory.offload.embeddings``)."""
    from memtrain.config.schema import RunConfig

    model: Any = RunConfig
    for part in path.split("."):
        info = model.model_fields[part]
        model = info.annotation
    return info


def test_every_knob_is_a_described_recipe_field_that_accepts_auto() -> None:
    """A technique's recipe field lives in the schema (validated before torch loads, so it cannot
    live in the technique's module): every knob names one, described, and a plannable one accepts
    `auto`. Planted: a knob on a field the schema lacks -> KeyError."""
    from pydantic import TypeAdapter

    for knob in patches.knobs():
        info = _field(knob.path)
        assert info.description, f"{knob.path}: no description in the recipe schema"
        if knob.plannable:
            TypeAdapter(info.annotation).validate_python("auto")  # raises if `auto` is not allowed
    with pytest.raises(KeyError):
        _field("memory.tiled_mlp_tile_size")


def test_a_library_error_inside_a_patch_names_its_recipe_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``apply_patches`` for training, the estimate and the plugin: a library exception raised
    inside a patch comes out as a BuildError naming that patch's recipe field (planted: the hook
    called without ``recipe_stage`` -> a bare RuntimeError)."""
    from memtrain.errors import BuildError

    entry = patches.technique("tiled_mlp")

    def broken(model: nn.Module, cfg: Any) -> nn.Module:
        raise RuntimeError("shape mismatch in a library\nsecond line")

    import dataclasses

    monkeypatch.setattr(patches, "techniques", lambda: [dataclasses.replace(entry, hook=broken)])
    with pytest.raises(BuildError, match=r"^`memory.tiled_mlp`: applying the tiled_mlp patch failed: "
                                         r"RuntimeError: shape mismatch in a library\. Fix: check"):
        patches.apply_patches(nn.Linear(2, 2), recipe(), only=["tiled_mlp"])
