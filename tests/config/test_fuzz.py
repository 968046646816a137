"""Fuzzing the recipe loader: malformed YAML or overrides give exit 2 and a message, never a traceback."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config.schema import RunConfig

runner = CliRunner()
SECTION_KEYS = {name: list(f.annotation.model_fields) if hasattr(f.annotation, "model_fields") else []
                for name, f in RunConfig.model_fields.items()}
KEYS = st.sampled_from([*SECTION_KEYS, *{k for ks in SECTION_KEYS.values() for k in ks}, "x", "", "0"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["auto", "24GiB", "nf4", "lora", "full"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(KEYS, inner, max_size=4)),
                      max_leaves=12)
RECIPES = st.dictionaries(st.sampled_from(list(SECTION_KEYS)),
                          st.one_of(st.dictionaries(KEYS, VALUES, max_size=5), SCALARS), max_size=7)
FIELD_PATHS = st.sampled_from([f"{s}.{k}" for s, ks in SECTION_KEYS.items() for k in ks]
                              + ["memory.offload.activations", "memory.randomized_linear.ratio",
                                 "model.from_config.hidden_size", "training.lr.x"])
OVERRIDES = st.lists(st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.text(max_size=20), st.text(max_size=20)),
    st.builds(lambda k, v: f"{k}={v}", FIELD_PATHS, st.one_of(st.text(max_size=12), SCALARS.map(str))),
    st.text(max_size=30),
), max_size=4)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def run_validate(text: str, overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.yaml"
        path.write_text(text, encoding="utf-8")
        result = runner.invoke(app, ["validate", str(path), "--", *overrides])
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    if result.exit_code == 2:
        assert "error:" in result.output


@SETTINGS
@given(st.text(max_size=200), OVERRIDES)
def test_arbitrary_text_never_crashes(text: str, overrides: list[str]) -> None:
    run_validate(text, overrides)


@SETTINGS
@given(OVERRIDES)
def test_overrides_on_a_valid_recipe_never_crash(overrides: list[str]) -> None:
    from memtrain.config import shipped_recipes_dir

    run_validate((shipped_recipes_dir() / "quickstart.yaml").read_text(), overrides)


@SETTINGS
@given(RECIPES, OVERRIDES)
def test_recipe_shaped_yaml_never_crashes(recipe: dict, overrides: list[str]) -> None:
    import yaml

    run_validate(yaml.safe_dump(recipe, allow_unicode=True), overrides)
