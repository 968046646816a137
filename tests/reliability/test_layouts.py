"""Where recovery may cut a batch: the layout detectors, on batches laid out as TRL's collators
lay them out (built here by hand; the trainers themselves run in tests/plugin/test_trl.py).

TRL's trainers are stood in for by empty classes in a ``trl.*`` module, which is what the detectors
look at (TRL is not imported).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memtrain.reliability.layouts import (
    Packed,
    Pairs,
    Rows,
    Unsplittable,
    count_items,
    layout_of,
)


def trl_trainer(name: str, **attributes: Any) -> Any:
    """An object whose class looks like TRL's ``name`` to the detectors."""
    cls = type(name, (), {"__module__": f"trl.trainer.{name.lower()}"})
    obj = cls()
    obj.__dict__.update(attributes)
    return obj


def preference_batch(pairs: int, length: int = 6, with_ref: bool = True) -> dict[str, torch.Tensor]:
    """[chosen; rejected] as TRL's DPO collator stacks it: row i is pair i's chosen, row pairs+i its
    rejected (ids encode pair and side: 100 * pair + 1 chosen / 2 rejected)."""
    chosen = torch.tensor([[100 * i + 1] * length for i in range(pairs)])
    rejected = torch.tensor([[100 * i + 2] * length for i in range(pairs)])
    batch = {"input_ids": torch.cat([chosen, rejected]), "attention_mask": torch.ones(2 * pairs, length),
             "completion_mask": torch.ones(2 * pairs, length)}
    if with_ref:
        batch["ref_chosen_logps"] = torch.arange(pairs, dtype=torch.float) + 0.1
        batch["ref_rejected_logps"] = torch.arange(pairs, dtype=torch.float) + 0.2
    return batch


def test_dpo_pieces_keep_each_pair_and_its_reference_log_probs_together() -> None:
    batch = preference_batch(5)
    layout = layout_of(trl_trainer("DPOTrainer", loss_types=["sigmoid"]), batch)
    assert isinstance(layout, Pairs) and layout.count == 5 and layout.unit == "preference pair"
    pieces = layout.split(2)
    assert [p["input_ids"].shape[0] for p in pieces] == [4, 6]  # 2 and 3 pairs, both halves each
    for piece in pieces:
        ids = piece["input_ids"][:, 0]
        pairs = len(ids) // 2
        assert (ids[:pairs] % 100 == 1).all() and (ids[pairs:] % 100 == 2).all()  # [chosen; rejected]
        assert (ids[:pairs] // 100 == ids[pairs:] // 100).all()  # row i and pairs+i: the same pair
        assert (piece["ref_chosen_logps"] - 0.1).round().long().tolist() == (ids[:pairs] // 100).tolist()
        assert (piece["ref_rejected_logps"] - 0.2).round().long().tolist() == (ids[pairs:] // 100).tolist()
    # outputs put back in the batch's order: every chosen row, then every rejected one
    assert torch.equal(layout.join([p["input_ids"] for p in pieces], 2), batch["input_ids"])
    assert torch.equal(layout.join([p["ref_chosen_logps"] for p in pieces], 2), batch["ref_chosen_logps"])
    assert count_items(object(), batch, layout) == 5
    assert [count_items(object(), p, layout_of(trl_trainer("DPOTrainer"), p)) for p in pieces] == [2, 3]
    reward = layout_of(trl_trainer("RewardTrainer"), {**preference_batch(4, with_ref=False),
                                                       "margin": torch.zeros(4)})
    assert isinstance(reward, Pairs) and reward.split(4)[3]["margin"].shape == (1,)


def test_a_plain_trainer_splits_the_same_batch_by_rows() -> None:
    layout = layout_of(object(), preference_batch(4, with_ref=False))
    assert isinstance(layout, Rows) and layout.count == 8


def packed_row(lengths: list[int], pad: int = 0) -> dict[str, Any]:
    """One row of sequences as TRL's padding-free collator builds it (``pad`` trailing pad tokens)."""
    positions = torch.cat([torch.arange(n) for n in [*lengths, *([1] * pad)]])[None]
    tokens = positions.shape[1]
    starts = (positions[0] == 0).nonzero().flatten()
    bounds = torch.cat([starts, torch.tensor([tokens])]).to(torch.int32)
    labels = torch.arange(tokens)[None].clone()
    labels[positions == 0] = -100
    return {"input_ids": torch.arange(tokens)[None] + 1000, "labels": labels, "position_ids": positions,
            "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": int(bounds.diff().max()),
            "max_length_k": int(bounds.diff().max()),
            "seq_idx": torch.repeat_interleave(torch.arange(len(bounds) - 1, dtype=torch.int32),
                                               bounds.diff())[None]}


def test_a_packed_row_splits_at_sequence_boundaries() -> None:
    batch = packed_row([5, 3, 7, 2, 4])
    layout = layout_of(trl_trainer("SFTTrainer"), batch)
    assert isinstance(layout, Packed) and layout.count == 5 and layout.unit == "packed sequence"
    first, second = layout.split(2)
    assert first["input_ids"].shape == (1, 8) and second["input_ids"].shape == (1, 13)  # 5+3 | 7+2+4
    assert first["cu_seq_lens_q"].tolist() == [0, 5, 8] and second["cu_seq_lens_k"].tolist() == [0, 7, 9, 13]
    assert (first["max_length_q"], second["max_length_k"]) == (5, 7)
    assert first["seq_idx"].tolist() == [[0] * 5 + [1] * 3] and second["seq_idx"][0, 0] == 0
    assert second["position_ids"][0, 0] == 0  # each piece starts a sequence
    assert torch.equal(layout.join([first["input_ids"], second["input_ids"]], 2), batch["input_ids"])
    # every label of the row is in exactly one piece: a causal loss over tokens adds up
    kept = sum(int(p["labels"].ne(-100).sum()) for p in (first, second))
    assert kept == int(batch["labels"].ne(-100).sum())
    # without the boundary keys, restarting position_ids are enough (memtrain's own packing)
    plain = layout_of(object(), {k: batch[k] for k in ("input_ids", "labels", "position_ids")})
    assert isinstance(plain, Packed) and [p["input_ids"].shape[1] for p in plain.split(5)] == [5, 3, 7, 2, 4]


def test_a_packed_row_with_a_tensor_across_its_sequences_is_refused() -> None:
    batch = {**packed_row([4, 4]), "attention_mask_4d": torch.ones(1, 1, 8, 8)}
    layout = layout_of(trl_trainer("SFTTrainer"), batch)
    assert isinstance(layout, Unsplittable) and "attention_mask_4d" in (layout.refusal or "")
    one = layout_of(trl_trainer("SFTTrainer"), packed_row([9]))  # one sequence: nothing to cut
    assert one.count == 1


@pytest.mark.parametrize(("trainer", "words"), [
    (trl_trainer("KTOTrainer", calculate_KL=True), "KL baseline"),
    (trl_trainer("DPOTrainer", loss_types=["sigmoid", "sft"]), "['sft']"),
    (trl_trainer("DPOTrainer", loss_types=["aot"]), "sorts the log-ratios"),
    (trl_trainer("ORPOTrainer"), "NLL term"),
    (trl_trainer("CPOTrainer", cpo_alpha=1.0), "NLL term"),
])
def test_trainers_whose_loss_couples_the_batch_are_refused(trainer: Any, words: str) -> None:
    layout = layout_of(trainer, preference_batch(4))
    assert isinstance(layout, Unsplittable) and words in (layout.refusal or "")
    assert layout.count == (4 if type(trainer).__name__ == "DPOTrainer" else 8)


def test_a_tensor_that_is_not_per_row_is_refused_not_shared() -> None:
    batch = {"input_ids": torch.zeros(4, 6, dtype=torch.long), "pixel_values": torch.zeros(3, 3, 8, 8)}
    layout = layout_of(object(), batch)
    assert isinstance(layout, Unsplittable) and "`pixel_values` has 3 rows" in (layout.refusal or "")
    dpo = layout_of(trl_trainer("DPOTrainer", loss_types=["sigmoid"]),
                    {**preference_batch(2), "pixel_values": torch.zeros(3, 8)})
    assert isinstance(dpo, Unsplittable) and dpo.unit == "preference pair"
