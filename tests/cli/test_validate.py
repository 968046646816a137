"""`memtrain validate`: the verdict first, the data read with `--data` (every bad row, exit 2), the
resolved recipe only with `--show` (issue 35: it said ok without reading the data, after 170 lines
of YAML)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import causal_recipe, write_jsonl
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import dump_recipe, load_recipe

runner = CliRunner()
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def recipe_file(tmp_path: Path, rows: list[dict], **data) -> str:
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(causal_recipe(tmp_path, source, data={"max_length": 64, **data})))
    return str(path)


def validate(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["validate", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.stdout.split()), " ".join(result.stderr.split())


def test_bad_rows_pass_without_data_and_exit_2_with_it(tmp_path: Path) -> None:
    path = recipe_file(tmp_path, [{"messages": CHAT[:1]}] * 12, format="messages", eval_split=0.25)
    code, _, err = validate(path)
    assert code == 0 and "its data was not read (--data reads it)" in err, err
    code, _, err = validate(path, "--data")
    assert code == 2, err
    assert ("12 of the 12 rows cannot be used (rows count from 1, in the order of the data): - "
            "`data.messages_column`: rows 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more: the conversation has "
            "no assistant message") in err, err


def test_sharegpt_rows_name_the_format_and_the_fix_validates(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}] * 5
    path = recipe_file(tmp_path, rows, format="messages")
    code, _, err = validate(path, "--data")
    assert code == 2 and "Fix: `conversations` holds ShareGPT conversations (`from`/`value` turns): " \
        "set `data.format: sharegpt`." in err, err
    code, _, err = validate(path, "data.format=sharegpt", "--data")
    assert code == 0 and "ok:" in err and "data read: 5 training examples, the longest" in err, err


def test_data_with_max_length_auto_is_read_uncut(tmp_path: Path) -> None:
    path = recipe_file(tmp_path, [{"text": "word " * 300}] * 4, max_length="auto")
    code, _, err = validate(path, "--data")
    assert code == 0, err
    assert "4 training examples, the longest" in err and "(uncut: data.max_length is auto" in err, err
    longest = int(err.split("the longest ")[1].split()[0])
    assert longest > 300  # not cut at 512 or at any other default


def test_grpo_prompts_with_max_length_auto_are_read_uncut() -> None:
    """GRPO's checks on the data (rewards on a real row) read the prompts uncut too: with an `auto`
    length they failed, saying the length must be planned before the data is tokenized."""
    code, _, err = validate("recipes/tiny-llama-grpo.yaml", "data.max_length=auto", "--data")
    assert code == 0, err
    assert "ok:" in err and "(uncut: data.max_length is auto" in err, err


def test_the_verdict_comes_first_and_the_recipe_only_when_asked() -> None:
    code, out, err = validate("quickstart", "training.epochs=2")
    assert code == 0 and out == "" and err.startswith("ok: quickstart is a valid recipe"), (out, err)
    result = runner.invoke(app, ["validate", "quickstart", "training.epochs=2", "--show"])
    assert result.exit_code == 0
    assert result.output.index("ok: quickstart") < result.output.index("model:")
    assert yaml.safe_load(result.stdout) == yaml.safe_load(dump_recipe(load_recipe("quickstart",
                                                                                   ["training.epochs=2"])))


@pytest.mark.parametrize("flag", ["--data", "--show"])
def test_a_bad_recipe_still_exits_2_before_anything_is_read(tmp_path: Path, flag: str) -> None:
    path = recipe_file(tmp_path, [{"messages": CHAT}], format="messages")
    code, out, err = validate(path, "adapter.rank=4", flag)
    assert code == 2 and out == "" and "`adapter.rank`: unknown key. Fix: did you mean `r`?" in err, err


@pytest.mark.parametrize(("arch", "memory", "said"), [
    ("gpt2", {"lean_norm": True},
     "`memory.lean_norm`: got true, but GPT2LMHeadModel has no norm this patch knows"),
    ("llama", {"offload": {"embeddings": True}, "tiled_mlp": "auto"},
     "`memory.offload.embeddings`: the output head shares the input embedding's weight"),
])
def test_a_technique_the_model_cannot_take_is_refused_before_anything_loads(
        tmp_path: Path, tiny_text_file: Path, arch: str, memory: dict, said: str) -> None:
    """Caught by a fake build from the config (it was only once the model loaded); what the fix
    says validates, and an `auto` field is the planner's to skip, not a mistake."""
    recipe = causal_recipe(tmp_path, tiny_text_file, arch, memory=memory)
    recipe["model"]["from_config"]["tie_word_embeddings"] = True
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = validate(str(path))
    assert code == 2 and said in err, err
    field = said.split("`")[1]
    code, _, err = validate(str(path), f"{field}=false")
    assert code == 0, err
    code, _, err = validate(str(path), f"{field}=auto")
    assert code == 0, err


def test_every_stage_reports_one_hides_no_other(tmp_path: Path, tiny_text_file: Path) -> None:
    """A missing data file, a length past the model's positions and a technique the model cannot
    take: all three in one error (validate stopped at the first, and the fix of one showed the next).
    (Planted: the stages raising as they find -> fails.)"""
    recipe = causal_recipe(tmp_path, tiny_text_file, "gpt2", memory={"lean_norm": True})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = validate(str(path), f"data.source={tmp_path / 'gone.jsonl'}", "data.max_length=99999",
                            "--data")
    assert code == 2 and "r.yaml: 3 problems:" in err, err
    for said in ("`data.source`: cannot be found", "`data.max_length`: 99,999 tokens exceed",
                 "`memory.lean_norm`: got true"):
        assert err.count(said) == 1, (said, err)
    code, _, err = validate(str(path), "data.max_length=99999")  # a file that exists: two, data read
    assert code == 2 and "r.yaml: 2 problems:" in err and "cannot be found" not in err, err


def test_a_pad_token_outside_the_vocabulary_is_named_before_training(tmp_path: Path) -> None:
    """Phi-3 from a config keeps its default pad_token_id 32000; with a 30,522-token vocabulary
    validate said ok and train crashed in torch ("Padding_idx must be within num_embeddings",
    exit 1). Planted: the check off -> validate exits 0."""
    phi3 = {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 30522,
            "max_position_embeddings": 256}
    source = write_jsonl(tmp_path / "rows.jsonl", [{"text": "a line of text"}] * 4)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(causal_recipe(tmp_path, source, model={"from_config": phi3})))
    code, _, err = validate(str(path))
    assert code == 2, err
    assert ("`model.from_config.pad_token_id`: phi3's default pad token id is outside the vocabulary of "
            "30,522 tokens (`vocab_size`)" in err and "got 32000" in err
            and "Fix: set `model.from_config.pad_token_id` to an id below 30522" in err), err
    code, _, err = validate(str(path), "model.from_config.pad_token_id=0")
    assert code == 0, err


def test_lora_dropout_on_fused_expert_weights_names_adapter_dropout(tmp_path: Path) -> None:
    """peft refuses dropout on Mixtral's fused expert weights (its ParamWrapper): that surfaced as
    "`adapter`: applying the lora patch failed ... check `adapter`" at train, and validate said ok.
    Planted: the translation off -> validate exits 0."""
    mixtral = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
               "num_experts_per_tok": 2, "vocab_size": 30522, "max_position_embeddings": 256}
    source = write_jsonl(tmp_path / "rows.jsonl", [{"text": "a line of text"}] * 4)
    path = tmp_path / "r.yaml"
    recipe = causal_recipe(tmp_path, source, model={"from_config": mixtral}, adapter={"dropout": 0.05})
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = validate(str(path))
    assert code == 2, err
    assert "`adapter.dropout`: LoRA on this model's fused expert weights takes no dropout" in err, err
    assert "got 0.05. Fix: set `adapter.dropout: 0`." in err, err
    code, _, err = validate(str(path), "adapter.dropout=0")
    assert code == 0, err
