"""Packing keeps documents apart: a packed batch's loss is that of its documents run one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import causal_recipe, tiny_model

from memtrain.data.chat import IGNORE_INDEX
from memtrain.data.packing import PackedCollator, pack_examples


def _documents(seed: int) -> list[tuple[list[int], list[int]]]:
    """Token documents of mixed lengths; some with an untrained prompt, like chat examples."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(9):
        n = int(torch.randint(2, 20, (1,), generator=g))
        ids = torch.randint(3, 512, (n,), generator=g).tolist()
        prompt = n // 2 if i % 3 == 0 else 0
        docs.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return docs


def _one_by_one(model, docs) -> float:
    total = count = 0.0
    for ids, labels in docs:
        n = sum(1 for y in labels[1:] if y != IGNORE_INDEX)
        if n == 0:
            continue
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
        total += out.loss.item() * n
        count += n
    return total / count


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                            ("gpt2", "eager")])
def test_packed_loss_equals_documents_one_by_one(arch: str, attn: str) -> None:
    model = tiny_model(arch, attn_implementation=attn).float().eval()
    model.config.use_cache = False  # as the Trainer sets it (TrainingArguments.use_cache)
    docs = _documents(0)
    rows = pack_examples(docs, block=32, split_long=False)
    assert len(rows["input_ids"]) < len(docs)  # several documents share rows
    features = [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]
    batch = PackedCollator(pad_token_id=0)(features)
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed = model(**batch).loss.item()
        expected = _one_by_one(model, docs)
        # the same rows with positions running on and full attention: documents see each other
        leaky = model(input_ids=batch["input_ids"], labels=batch["labels"],
                      attention_mask=torch.ones_like(batch["input_ids"])).loss.item()
    assert packed == pytest.approx(expected, abs=1e-5)
    assert abs(leaky - expected) > 1e-4  # far outside the tolerance above


def test_positions_restart_and_first_tokens_are_not_targets() -> None:
    rows = pack_examples([([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 5]), ([6, 7, 8, 9], [6, 7, 8, 9])],
                         block=6, split_long=False)
    assert rows["input_ids"] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert rows["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 2, 3]]
    assert rows["labels"] == [[-100, 2, 3, -100, 5], [-100, 7, 8, 9]]
    batch = PackedCollator(pad_token_id=0)([{k: v[1] for k, v in rows.items()},
                                            {k: v[0] for k, v in rows.items()}])
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 0]  # padding: a block of its own
    assert batch["labels"][0].tolist() == [-100, 7, 8, 9, -100]


def test_long_text_continues_other_formats_are_cut() -> None:
    doc = (list(range(1, 11)), list(range(1, 11)))
    assert pack_examples([doc], block=4, split_long=True)["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8],
                                                                           [9, 10]]
    assert pack_examples([doc], block=4, split_long=False)["input_ids"] == [[1, 2, 3, 4]]


@pytest.mark.slow
def test_chat_data_packs_and_trains(tmp_path: Path) -> None:
    from memtrain.config import load_recipe
    from memtrain.run.train import train

    rows = [{"messages": [{"role": "user", "content": f"what is {i} and {i}"},
                          {"role": "assistant", "content": f"it is {2 * i}"}]} for i in range(40)]
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_recipe(causal_recipe(tmp_path, f, data={"format": "messages", "packing": True,
                                                       "max_length": 64, "eval_split": 0.1}))
    result = train(cfg)
    assert result.metrics["train_loss"] > 0 and "eval_loss" in result.metrics
    assert result.model.config.use_cache is False  # else transformers ignores the boundaries
