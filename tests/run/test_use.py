"""Using a trained run: merge (logits unchanged), generate (prompt written like the data), predict."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import MINILM, TINY_CONFIGS, causal_recipe
from safetensors.torch import load_file
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe
from memtrain.run.inference import format_prompt, load_run
from memtrain.run.train import train

cli = CliRunner()


def _chat_file(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"count to {i}"},
                          {"role": "assistant", "content": " ".join(str(k) for k in range(i))}]}
            for i in range(2, 18)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


IDS = torch.randint(0, 30522, (2, 24), generator=torch.Generator().manual_seed(0))
TRAINED_LOGITS: dict[str, torch.Tensor] = {}  # run folder -> the trained model's logits on IDS


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    model.train(was_training)
    return out


def _train(tmp: Path, data_file: Path, **sections) -> Path:
    result = train(load_recipe(causal_recipe(tmp, data_file, **sections)))
    TRAINED_LOGITS[str(tmp / "run")] = _logits(result.model)
    return tmp / "run"


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("chat")
    return _train(tmp, _chat_file(tmp / "c.jsonl"), data={"format": "messages", "max_length": 64},
                  training={"max_steps": 3, "learning_rate": 1e-2})


def test_merge_gives_the_adapter_models_logits(chat_run: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    result = cli.invoke(app, ["merge", str(chat_run), "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    adapted = load_run(chat_run).model
    delta = adapted.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert delta.abs().max() > 0  # the adapter trained: merging changes the weights
    # the reloaded adapter model is the trained one (same seeded base), and merging keeps it
    torch.testing.assert_close(_logits(adapted), TRAINED_LOGITS[str(chat_run)], atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(merged), _logits(adapted), atol=1e-4, rtol=0)


def test_merge_dequantizes_a_4bit_base(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run_dir = _train(tmp_path, _chat_file(tmp_path / "c.jsonl"),
                     model={"quantization": "nf4", "dtype": "fp32"},
                     data={"format": "messages", "max_length": 64},
                     training={"max_steps": 2, "learning_rate": 1e-2})
    result = cli.invoke(app, ["merge", str(run_dir)])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged").eval()
    assert "quantization_config" not in json.loads((run_dir / "merged" / "config.json").read_text())
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    torch.testing.assert_close(_logits(merged), TRAINED_LOGITS[str(run_dir)], atol=1e-4, rtol=0)


def test_merge_refuses_a_full_model_and_a_non_run(tmp_path: Path) -> None:
    result = cli.invoke(app, ["merge", str(tmp_path)])
    assert result.exit_code == 2 and "not a finished run" in result.output


def test_generate_uses_the_chat_template(chat_run: Path) -> None:
    run = load_run(chat_run)
    prompt = run.tokenizer.decode(format_prompt(run, "count to 3"))
    assert prompt.startswith("< | im _ start | > user count to 3") and prompt.endswith("assistant")
    result = cli.invoke(app, ["generate", str(chat_run), "count to 3", "--max-new-tokens", "4"])
    assert result.exit_code == 0 and result.output.strip(), result.output
    chat = cli.invoke(app, ["generate", str(chat_run), "--max-new-tokens", "3"], input="hi\nagain\n")
    assert chat.exit_code == 0 and chat.output.count("> ") == 2, chat.output
    # `--input` is an alpaca prompt's: on a chat run it was ignored, silently
    ignored = cli.invoke(app, ["generate", str(chat_run), "count to 3", "--input", "by twos"])
    assert ignored.exit_code == 2 and "`--input` is the input of an alpaca instruction" in ignored.output


def test_loading_a_run_prints_no_deprecation_of_transformers_names(chat_run: Path) -> None:
    """peft's ``PeftModel.from_pretrained`` reads ``is_gradient_checkpointing``, which transformers
    5.24 renamed: a FutureWarning for every user of ``load_run`` (the command line hides
    FutureWarnings; the Python API does not). (Planted: the adapter loaded bare -> this fails on
    5.24; 5.19-5.23 never warn.)"""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        run = load_run(chat_run)
    assert run.model is not None


def test_generate_writes_alpaca_prompts_like_training(tmp_path: Path) -> None:
    rows = [{"instruction": f"say {w}", "output": w} for w in ("yes", "no", "maybe", "never")] * 3
    f = tmp_path / "a.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    run_dir = _train(tmp_path, f, data={"format": "alpaca", "max_length": 64},
                     training={"max_steps": 1})
    run = load_run(run_dir)
    text = run.tokenizer.decode(format_prompt(run, "say yes"))
    assert text.startswith("[CLS] below is an instruction") and text.endswith("# # # response :")


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cls")
    f = tmp / "cls.csv"
    f.write_text("text,label\n" + "".join(f"the {a} number {i},{a}\n" for i in range(32)
                                           for a in ("cat", "dog")))
    cfg = {"model": {"from_config": dict(TINY_CONFIGS["bert"]), "tokenizer": MINILM,
                     "task": "sequence-classification"},
           "data": {"source": str(f), "format": "classification", "max_length": 16,
                    "eval_split": 0.0},
           "adapter": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
           "training": {"micro_batch_size": 8, "gradient_accumulation": 1, "max_steps": 2,
                        "save_strategy": "no"},
           "output": {"dir": str(tmp / "run"), "report": False}}
    train(load_recipe(cfg))
    return tmp / "run"


def test_predict_writes_labels_and_scores(classifier_run: Path, tmp_path: Path) -> None:
    texts = tmp_path / "new.jsonl"
    texts.write_text("\n".join(json.dumps({"text": t}) for t in ["a cat", "a dog", "a bird"]))
    assert json.loads((classifier_run / "labels.json").read_text()) == ["cat", "dog"]
    result = cli.invoke(app, ["predict", str(classifier_run), str(texts), "--out",
                              str(tmp_path / "p.csv")])
    assert result.exit_code == 0, result.output
    with (tmp_path / "p.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["text"] for r in rows] == ["a cat", "a dog", "a bird"]
    for r in rows:
        assert r["label"] in ("cat", "dog")
        assert float(r["score_cat"]) + float(r["score_dog"]) == pytest.approx(1, abs=1e-5)
        assert float(r["score"]) == max(float(r["score_cat"]), float(r["score_dog"]))
    printed = cli.invoke(app, ["predict", str(classifier_run), str(texts)])
    assert printed.exit_code == 0 and len(printed.output.strip().splitlines()) == 3


def test_predict_and_generate_refuse_the_wrong_kind_of_run(chat_run: Path, classifier_run: Path,
                                                            tmp_path: Path) -> None:
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"text": "x"}))
    result = cli.invoke(app, ["predict", str(chat_run), str(texts)])
    assert result.exit_code == 2 and "needs a classifier run" in result.output
    result = cli.invoke(app, ["generate", str(classifier_run), "hi"])
    assert result.exit_code == 2 and "use `memtrain predict`" in result.output


@pytest.mark.parametrize("damage", ["no weights", "weights cut short", "config cut short"])
def test_a_damaged_run_folder_names_the_file_and_the_fix(chat_run: Path, tmp_path: Path, damage: str) -> None:
    """A run copied half-way: without its weights, transformers and peft looked for the folder on the
    Hub (an internal error about a repository id); cut-short weights or JSON were tracebacks too.
    Planted: either check off -> an internal error, exit 1."""
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(chat_run, run)
    weights = run / "adapter_model.safetensors"
    if damage == "no weights":
        weights.unlink()
    elif damage == "weights cut short":
        weights.write_bytes(weights.read_bytes()[:4000])
    else:
        (run / "adapter_config.json").write_text('{"r": 4,')
    result = cli.invoke(app, ["generate", str(run), "hi"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    expected = {"no weights": "has no weights (none of adapter_model.safetensors, adapter_model.bin)",
                "weights cut short": "cannot be read",
                "config cut short": "adapter_config.json' is not valid JSON"}
    assert expected[damage] in said and "Fix: " in said, said


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["alpaca", "sharegpt"])
def test_the_documented_examples_train_and_generate(kind: str, tmp_path: Path) -> None:
    """docs/DATA.md's alpaca and ShareGPT examples, end to end through the CLI."""
    recipe = EXAMPLES / f"{kind}.yaml"
    assert recipe.read_text().splitlines()[0] == f"# memtrain train docs/examples/{kind}.yaml"
    run_dir = tmp_path / "run"
    result = cli.invoke(app, ["train", str(recipe), f"data.source={EXAMPLES / f'{kind}.jsonl'}",
                              f"output.dir={run_dir}"])
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / "metrics.json").read_text())["eval_loss"] > 0
    result = cli.invoke(app, ["generate", str(run_dir), "Who wrote Hamlet?", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output


def test_a_pretrained_classifier_loads_without_transformers_reporting_its_head_missing(
        tmp_path: Path) -> None:
    """The base loads with a new head, which transformers reports as MISSING ("newly initialized ...
    consider training"); the adapter then puts the trained head back. The report read as if
    predictions came from a random head. (Planted: the base loaded unquieted -> fails.)"""
    f = tmp_path / "cls.csv"
    f.write_text("text,label\n" + "".join(f"the {a} {i},{a}\n" for i in range(4) for a in ("cat", "dog")))
    cfg = {"model": {"name": MINILM, "task": "sequence-classification"},
           "data": {"source": str(f), "format": "classification", "max_length": 16, "eval_split": 0.0},
           "adapter": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
           "training": {"micro_batch_size": 8, "gradient_accumulation": 1, "max_steps": 1,
                        "save_strategy": "no"},
           "output": {"dir": str(tmp_path / "run"), "report": False}}
    trained = train(load_recipe(cfg))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)  # its records do not propagate
    try:
        run = load_run(trained.output_dir)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in said if "MISSING" in m], said
    head = run.model.base_model.model.classifier.modules_to_save["default"].weight
    saved = load_file(trained.output_dir / "adapter_model.safetensors")
    assert torch.equal(head, next(v for k, v in saved.items() if k.endswith("classifier.weight")))


def test_predict_refuses_rows_without_text(classifier_run: Path, tmp_path: Path) -> None:
    """A null, a missing key, an empty CSV cell or a blank line of a .txt file is no text: the command
    names the rows and exits 2 (it used to classify the string "None", and a blank line)."""
    texts = tmp_path / "holes.jsonl"
    texts.write_text("\n".join(json.dumps(r) for r in [{"text": "a cat"}, {"text": None}, {"other": 1}]))
    result = cli.invoke(app, ["predict", str(classifier_run), str(texts)])
    assert result.exit_code == 2, result.output
    assert "row 2, 3" in result.output and "'text'" in result.output and "None" not in result.output
    cells = tmp_path / "holes.csv"
    cells.write_text("text\na dog\n\"\"\n")
    result = cli.invoke(app, ["predict", str(classifier_run), str(cells)])
    assert result.exit_code == 2 and "row 2" in result.output, result.output
    lines = tmp_path / "holes.txt"  # a blank line, and one of spaces, are rows of no text too
    lines.write_text("a cat\n\na dog\n   \na bird\n")
    result = cli.invoke(app, ["predict", str(classifier_run), str(lines)])
    assert result.exit_code == 2, result.output
    assert "row 2, 4" in result.output and "rows are its lines" in result.output


def test_models_load_with_their_own_layers_not_hub_kernels(tmp_path: Path, monkeypatch) -> None:
    """From transformers 5.25 `from_pretrained` swaps layers for kernels from the Hugging Face Hub
    unless told not to (offline on CUDA it raises; the H200 session of 2026-12-04): every model
    memtrain loads, a 4-bit one built from a config (saved, then loaded quantized) and a trained
    full model's run folder, asks for none."""
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "set_use_kernels"):
        pytest.skip("this transformers has no Hub kernels")
    asked: list[object] = []
    original = PreTrainedModel.set_use_kernels

    def record(self, use_kernels, *args, **kwargs):
        asked.append(use_kernels)
        return original(self, use_kernels, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", record)
    from memtrain.model import load_model

    data = _chat_file(tmp_path / "c.jsonl")
    load_model(load_recipe(causal_recipe(tmp_path, data, model={"quantization": "nf4"})).model)
    assert asked == [False]
    run_dir = _train(tmp_path / "full", data, adapter={"method": "full"},
                     data={"format": "messages", "max_length": 64}, training={"max_steps": 1})
    asked.clear()
    load_run(run_dir)
    assert asked == [False]
