"""Every user mistake exits 2 with the field or file named, no traceback; nothing is accepted silently.

Each case builds its own bad input. The CLI runs in-process (typer's runner: the exit status and the
exception are the real ones); one case also runs as a real process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_CONFIGS, causal_recipe
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe
from memtrain.errors import MemtrainError

runner = CliRunner()


def run_cli(args: list[str]) -> str:
    """Run a command that must fail cleanly; returns its output."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and "error:" in result.output
    return " ".join(result.output.split())  # rich wraps long lines


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"to be or not to be {i}"}) for i in range(32)))
    return path


def recipe_file(tmp_path: Path, corpus: Path, name: str = "r", **sections) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(causal_recipe(tmp_path / name, corpus, **sections)))
    return str(path)


@pytest.fixture
def read_only(tmp_path: Path):
    """A folder to fill, then make read-only (a read-only tmpfs for root, whom modes do not stop)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    root = os.geteuid() == 0
    if root:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)], capture_output=True, check=False
        )
        if done.returncode:
            pytest.skip(f"root cannot be stopped by file modes, and no tmpfs here: {done.stderr!r}")

    def freeze() -> None:
        if root:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        else:
            folder.chmod(0o555)

    yield folder, freeze
    if root:
        subprocess.run(["umount", str(folder)], check=False)
    else:
        folder.chmod(0o755)


# ------------------------------------------------------------------------------------ train


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "empty.jsonl": "",
        "broken.jsonl": '{"text": "a"}\n{"text": \n',
        "nulltext.jsonl": '{"text": "a"}\n{"text": null}\n' * 3,
        "nulllabel.jsonl": '{"text": "a", "label": "x"}\n{"text": "b", "label": null}\n' * 3,
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "emptymodel").mkdir()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    (tmp_path / "afile").write_text("x")
    return {name: tmp_path / name for name in [*files, "emptymodel", "odd", "afile"]}


def test_train_mistakes_exit_2_naming_the_field(tmp_path: Path, corpus: Path) -> None:
    f = _bad_files(tmp_path)
    recipe = recipe_file(tmp_path, corpus)
    cases = {  # overrides -> what the message must name
        f"data.source={f['empty.jsonl']}": "`data.source`: has no examples",
        f"data.source={f['broken.jsonl']}": "line 2 is not valid JSON",
        f"data.source={f['nulltext.jsonl']}": "`data.text_column`: is empty (null) in train rows 2, 4 and 6",
        f"data.source={f['nulltext.jsonl']} data.max_length=1": "`data.max_length`: is too short",
        f"model.name={f['emptymodel']} model.from_config=null": "`model.name`: is an empty folder",
        f"model.name={f['odd']} model.from_config=null": "`model.name`: could not load",
        "model.from_config.model_type=no-such-model": "`model.from_config.model_type`: not a model type",
        # a typo: the close names, and the recipe's file in the header (not transformers' 800 types)
        "model.from_config.model_type=llamaa": f"{recipe}: 1 problem: - `model.from_config.model_type`: "
        "not a model type this transformers knows, got 'llamaa'. Fix: did you mean 'llama'",
        "model.from_config.num_attention_heads=5": "is not a multiple of the number of attention heads",
        f"output.dir={f['afile']}": "`output.dir`: '" + str(f["afile"]) + "' is a file",
        f"output.dir={f['afile'] / 'run'}": "`output.dir`: '"
        + str(f["afile"] / "run")
        + "' cannot be created",
        # the fixes fit the recipe (its simulated budget, no checkpoint to resume from, LoRA already)
        "memory.simulate_budget=1MiB": "Out of memory in optimizer step 1: Simulated: tried to allocate past "
        "the budget", "memory.simulate_budget=1MiB data.max_length=16": "No checkpoint had been saved yet. "
        "Fix: a larger `memory.simulate_budget`, a smaller `training.micro_batch_size` (`auto` probes what "
        "fits), `memory.checkpointing: full`, a shorter `data.max_length`, QLoRA (`model.quantization: "
        "nf4`), or the settings `memtrain plan` chooses for fields set to `auto`.",
        "training.learning_rate=true": "`training.learning_rate`: expected a number, got True",
        # a tokenizer with more ids than the model built from its config: an IndexError in the
        # embedding lookup ("internal error") before the check
        "model.from_config.vocab_size=64": "`model.from_config.vocab_size`: too small for the data's token "
        "ids (the largest is",
    }
    for overrides, expected in cases.items():
        assert expected in run_cli(["train", recipe, *overrides.split()]), overrides
    classification = [
        "data.format=classification",
        f"data.source={f['nulllabel.jsonl']}",
        "model.task=sequence-classification",
    ]
    assert "`data.label_column`: is empty (null) in train rows 2, 4 and 6" in run_cli(
        ["train", recipe, *classification]
    )


def test_a_truncated_weights_file_names_the_model(tmp_path: Path, corpus: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(TINY_CONFIGS["llama"], vocab_size=512)
    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model(values.pop("model_type"), **values)
    ).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = run_cli(["train", recipe_file(tmp_path, corpus), f"model.name={folder}", "model.from_config=null"])
    assert f"`model.name`: could not load '{folder}'" in out


def test_a_read_only_output_folder(tmp_path: Path, corpus: Path, read_only) -> None:
    folder, freeze = read_only
    freeze()
    out = run_cli(["train", recipe_file(tmp_path, corpus), f"output.dir={folder / 'run'}"])
    assert f"`output.dir`: '{folder}' is not writable" in out


def test_a_real_process_exits_2_without_a_traceback(tmp_path: Path, corpus: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "memtrain",
            "train",
            recipe_file(tmp_path, corpus),
            f"data.source={tmp_path / 'empty.jsonl'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout and "data.source" in done.stderr


def test_the_command_skips_teardown_but_keeps_its_output_and_status() -> None:
    """`memtrain` leaves with os._exit once its work is done (memtrain.cli.app._end_without_teardown):
    what it wrote into pipes (block-buffered) still arrives, with the command's exit status."""
    listing = subprocess.run([sys.executable, "-m", "memtrain", "recipes"], capture_output=True,
                             text=True, timeout=120, check=False)
    assert listing.returncode == 0 and "tiny-llama-shakespeare" in listing.stdout, listing.stderr
    wrong = subprocess.run([sys.executable, "-m", "memtrain", "validate", "no-such-recipe"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert wrong.returncode == 2 and "`recipe`: no such file" in wrong.stderr


# ----------------------------------------------------------------------- plan, estimate, report


def test_command_option_mistakes(tmp_path: Path, corpus: Path) -> None:
    recipe = recipe_file(tmp_path, corpus)
    assert "`--budget` must look like '24GiB'" in run_cli(["plan", recipe, "--budget", "24 gigs"])
    assert "`--budget` must look like '24GiB'" in run_cli(["plan", recipe, "--budget=-1GiB"])
    assert "`--device` must be cpu, cuda or cuda:N, got 'tpu'" in run_cli(["plan", recipe, "--device", "tpu"])
    missing = tmp_path / "nope" / "curves.png"
    assert f"`--plot`: the folder '{missing.parent}' does not exist" in run_cli(
        ["estimate", recipe, "--sweep", "--plot", str(missing)]
    )
    assert "`--plot` saves the curves of `--sweep`" in run_cli(["estimate", recipe, "--plot", "x.png"])


def test_report_on_a_read_only_folder(tmp_path: Path, corpus: Path, read_only) -> None:
    from memtrain.run.train import train

    folder, freeze = read_only
    run = causal_recipe(tmp_path, corpus, training={"max_steps": 1}, output={"report": True})
    done = train(load_recipe(run)).output_dir
    (folder / "memory_report.json").write_bytes((done / "memory_report.json").read_bytes())
    freeze()
    assert "`report`: cannot write" in run_cli(["report", str(folder)])


# --------------------------------------------------------------------------- silent acceptance


def test_duplicate_yaml_keys_are_an_error(tmp_path: Path, corpus: Path) -> None:
    path = Path(recipe_file(tmp_path, corpus))
    path.write_text(path.read_text() + "training:\n  max_steps: 3\n")
    out = run_cli(["validate", str(path)])
    assert "the key 'training' appears twice" in out


def test_save_strategy_no(tmp_path: Path, corpus: Path) -> None:
    recipe = recipe_file(tmp_path, corpus)
    assert load_recipe(recipe, ["training.save_strategy=no"]).training.save_strategy == "no"
    assert load_recipe(recipe, ["output.overwrite=yes"]).output.overwrite is True
    path = Path(recipe)
    path.write_text(path.read_text().replace("save_strategy: 'no'", "save_strategy: no"))
    with pytest.raises(MemtrainError, match=r"write it in quotes, `save_strategy: \"no\"`"):
        load_recipe(path)


@pytest.mark.parametrize(
    "override",
    [
        "training.learning_rate=true",
        "training.max_steps=false",
        "memory.checkpointing=true",
        "adapter.r=true",
    ],
)
def test_booleans_are_not_numbers(tmp_path: Path, corpus: Path, override: str) -> None:
    with pytest.raises(MemtrainError, match=rf"`{override.split('=')[0]}`: expected .*got (True|False)"):
        load_recipe(recipe_file(tmp_path, corpus), [override])
