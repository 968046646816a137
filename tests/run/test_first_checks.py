"""What a new user hits first (issue 35 part 3): an existing `output.dir` is refused before any
data, plan or model work; a greedy `generate` that makes nothing to show says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import causal_recipe
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.run import inference
from memtrain.run import train as run_train

cli = CliRunner()


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the data, planning or loading the model fails the test."""
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the output folder was checked")

    for name in ("prepare_data", "load_tokenizer", "build_model", "_plan"):
        monkeypatch.setattr(run_train, name, forbidden)


@pytest.mark.parametrize("extra", [{}, {"data": {"max_length": "auto"}, "memory": {"budget": "2GiB"}},
                                   {"training": {"micro_batch_size": "auto"}, "memory": {"budget": "2GiB"}}],
                         ids=["fixed", "length-auto", "micro-batch-auto"])
def test_a_finished_run_in_output_dir_is_refused_before_any_work(
        tmp_path: Path, tiny_text_file: Path, no_work: None, extra: dict[str, Any]) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file, **extra)
    out = Path(recipe["output"]["dir"])
    out.mkdir()
    (out / "metrics.json").write_text("{}", encoding="utf-8")
    with pytest.raises(MemtrainError, match=r"`output.dir`: .* already holds a finished run"):
        run_train.train(load_recipe(recipe))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    result = cli.invoke(app, ["train", str(path)])
    assert result.exit_code == 2 and "`output.dir`" in result.output, result.output
    assert "Traceback" not in result.output and "data.max_length=" not in result.output  # no plan shown


def test_foreign_files_and_an_impossible_resume_are_refused_before_any_work(
        tmp_path: Path, tiny_text_file: Path, no_work: None) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file)
    out = Path(recipe["output"]["dir"])
    out.mkdir()
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(MemtrainError, match=r"`output.dir`: .* holds files that are not a memtrain run"):
        run_train.train(load_recipe(recipe))
    (out / "notes.txt").unlink()
    (out / "metrics.json").write_text("{}", encoding="utf-8")
    with pytest.raises(MemtrainError, match=r"`training.resume`: .* holds a finished run"):
        run_train.train(load_recipe(recipe, ["training.resume=true"]))


# ----------------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("text")
    corpus = tmp / "text.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"the fox {i} jumps"}) for i in range(16)))
    return run_train.train(load_recipe(causal_recipe(tmp, corpus, training={"max_steps": 1}))).output_dir


def _loaded_with(monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    """`generate` loads the run, then ``change(run)`` alters its model."""
    load = inference.load_run

    def altered(run_dir: Any, dequantize: bool = False) -> inference.Run:
        run = load(run_dir, dequantize)
        change(run)
        return run

    monkeypatch.setattr(inference, "load_run", altered)


def test_greedy_generation_of_only_special_tokens_says_what_happened(
        text_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def silent(run: inference.Run) -> None:  # all logits equal: greedy takes token 0, [PAD]
        with torch.no_grad():
            run.model.get_output_embeddings().weight.zero_()

    _loaded_with(monkeypatch, silent)
    result = cli.invoke(app, ["generate", str(text_run), "the fox", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output  # generating worked; the model said nothing
    said = " ".join(result.output.split())
    assert ("note: the model generated only whitespace and special tokens (3 tokens): nothing to show. "
            "Fix: sample with `--temperature 0.7`") in said


def test_an_end_token_at_once_is_named(text_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    made = inference.continuation(inference.load_run(text_run), "the fox", 2)
    assert made.empty_because is None and made.text and len(made.tokens) == 2  # the usual case says nothing

    def ends(run: inference.Run) -> None:
        end = inference.end_token_id(run.tokenizer)
        run.model.generate = lambda input_ids, **kw: torch.cat([input_ids, torch.tensor([[end]])], 1)

    _loaded_with(monkeypatch, ends)
    result = cli.invoke(app, ["generate", str(text_run), "the fox", "--temperature", "0.5"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "note: the model generated only the end token (1 token): nothing to show" in said
    assert "a higher `--temperature`" in said
