"""The estimate is for the data at hand (issue 26, point 2): the longest batch the data makes, padded
only where a batch can be (memtrain/data/rows.py), traced on the attention path a real batch of that
layout takes.

The measured side is independent of the estimator's example batch: real rows collated by the
collator training uses (``DataCollatorForSeq2Seq``), one step counted by ``scripts/probes/memprobe.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import causal_recipe
from transformers import DataCollatorForSeq2Seq

from memtrain.config import load_recipe
from memtrain.data.prepare import prepare_data
from memtrain.data.rows import Rows, rows_of, worst_case
from memtrain.estimator.estimate import estimate
from memtrain.trainer.build import build_model, build_optimizer
from memtrain.trainer.step import training_step
from scripts.probes.memprobe import probe_step


def _cfg(tmp_path: Path, text_file: Path, micro: int = 2, **sections) -> object:
    return load_recipe(causal_recipe(tmp_path, text_file, data={"max_length": 64},
                                     training={"micro_batch_size": micro}, **sections))


def test_rows_say_when_a_batch_is_padded(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = _cfg(tmp_path, tiny_text_file)
    worst = worst_case(cfg)
    assert (worst.longest, worst.read) == (64, False)
    assert worst.padded(2) and not worst.padded(1)  # collators pad to a batch's own longest row
    assert rows_of(cfg, [10, 30, 20]) == Rows(30, uniform=False, packed=False, read=True)
    assert rows_of(cfg, [500, 7]).longest == 64  # never beyond data.max_length
    full = rows_of(cfg, [40, 40, 40])
    assert not full.padded(8) and "no padding" in full.describe(8)
    assert rows_of(cfg, []) == worst


def test_prepared_data_reads_its_longest_row(tmp_path: Path, tiny_text_file: Path, tokenizer) -> None:
    cfg = _cfg(tmp_path, tiny_text_file)
    data = prepare_data(cfg, tokenizer)
    lengths = [len(ids) for ids in data.train["input_ids"]]
    rows = data.rows(cfg)
    assert rows.longest == max(lengths) < cfg.data.max_length and rows.read
    note = estimate(cfg, device="cpu", rows=rows).notes[0]
    assert note.startswith(f"the data's longest row, {max(lengths)}")


def _measured_step(cfg, lengths: list[int], tokenizer) -> int:
    """One real step on rows of these lengths, collated as training collates them (the second
    step: optimizer state exists), counted by memprobe."""
    torch.manual_seed(0)
    model = build_model(cfg).train()
    optimizer = build_optimizer(cfg, model)
    collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    rows = [{"input_ids": list(range(5, 5 + n)), "attention_mask": [1] * n, "labels": list(range(5, 5 + n))}
            for n in lengths]
    batch = {k: v for k, v in collate(rows).items()}
    training_step(model, batch, optimizer)
    return probe_step(lambda: training_step(model, batch, optimizer), model, optimizer, batch)["peak"]


@pytest.mark.parametrize("lengths", [[48, 48], [48, 30], [48]], ids=["full rows", "padded", "one row"])
def test_the_estimate_equals_a_real_step_of_that_layout(tmp_path: Path, tiny_text_file: Path,
                                                        lengths: list[int], tokenizer) -> None:
    """Full rows and a batch of one take transformers' unmasked attention path (no 4D mask, keys
    and values not repeated per head for grouped-query attention); a padded batch the masked one.
    Before the fake mode answered the mask check, every trace took the masked path."""
    cfg = _cfg(tmp_path, tiny_text_file, micro=len(lengths), adapter={"method": "full"})
    rows = rows_of(cfg, lengths)
    predicted = estimate(cfg, device="cpu", rows=rows).peak_bytes
    assert predicted == _measured_step(cfg, lengths, tokenizer)


def test_a_padded_batch_holds_more_than_full_rows(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = _cfg(tmp_path, tiny_text_file, adapter={"method": "full"})
    full = estimate(cfg, device="cpu", rows=rows_of(cfg, [48, 48])).peak_bytes
    padded = estimate(cfg, device="cpu", rows=rows_of(cfg, [48, 30])).peak_bytes
    assert padded > full  # the 4D mask and GQA's repeated keys and values


def test_estimate_command_reads_the_data_when_asked(tmp_path: Path, tiny_text_file: Path) -> None:
    # `memtrain estimate --data` traces the data's longest row and says so; without it, rows of
    # data.max_length ("data is not read").
    import json

    import yaml
    from typer.testing import CliRunner

    from memtrain.cli.app import app

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(causal_recipe(tmp_path, tiny_text_file, data={"max_length": 64},
                                                   training={"micro_batch_size": 2})))
    runs = {flag: CliRunner().invoke(app, ["estimate", str(recipe), "--json", "--device", "cpu", *flag])
            for flag in ((), ("--data",))}
    assert all(r.exit_code == 0 for r in runs.values()), [r.output for r in runs.values()]
    blind, read = (json.loads(r.stdout[r.stdout.index("{"):]) for r in runs.values())
    assert blind["settings"]["seq_len"] == 64 and "data is not read" in blind["notes"][0]
    assert 12 < read["settings"]["seq_len"] < 64 and read["notes"][0].startswith(
        f"the data's longest row, {read['settings']['seq_len']} tokens")
    assert read["peak_bytes"] < blind["peak_bytes"]
