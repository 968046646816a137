"""``training.objective: dpo`` through ``memtrain train``: TRL's DPOTrainer step, estimated, counted
independently, recovered.

- The estimate of the DPO step (policy forward and backward on the 2B rows ``[chosen; rejected]``,
  the reference forward under ``no_grad`` with the LoRA adapter disabled, TRL's tiled log-prob
  head) equals what ``scripts/probes/memprobe.py`` counts in the real Trainer steps, up to two known
  terms: the counter adopts the tensors the model's forward is handed, and ``completion_mask``
  (one int64 per token, 2B x T) is not among them (the estimate counts the whole batch).
  Accelerate's ``loss / gradient_accumulation_steps`` (4 bytes) beside the loss is held by both,
  as in every Trainer step (tests/end_to_end/test_independent_count.py). DPO has no labels, so
  neither makes a token count.
- The reference is the base model with the adapter disabled: no second adapter (TRL adds a ``ref``
  copy when handed a PeftModel; memtrain removes it).
- Under a simulated budget the full micro-batch does not fit, recovery splits it by pairs, and the
  logged losses are those of the run without a budget.

Planted: TRL's default ``gradient_checkpointing=True`` left on (the DPOConfig not overriding it):
the count falls 1,033,088 bytes below the estimate (measured while building this); the ``ref``
adapter kept: the adapter assertion fails and the count rises above the estimate; recovery cutting
rows instead of pairs (``Rows`` for DPO batches): the losses differ (see tests/reliability).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from conftest import causal_recipe, merge
from rich.console import Console

from memtrain.config import load_recipe
from memtrain.data.prepare import prepare_data
from memtrain.estimator.estimate import estimate
from memtrain.memory.report import comparison, load_report
from memtrain.run.train import train
from scripts.probes.memprobe import trainer_steps

pytestmark = pytest.mark.slow

PAIRS, CHOSEN, LONGEST = 4, 8, 16  # 4 pairs of 6-word prompts; rejected answers 5 to 8 words


def _recipe(tmp_path: Path, **sections: Any) -> Any:
    rng = random.Random(0)
    words = ["cat", "dog", "sat", "mat", "the", "on", "a", "red"]  # one token each

    def say(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = [{"prompt": say(6), "chosen": " " + say(CHOSEN), "rejected": " " + say(5 + i)}
            for i in range(PAIRS)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    base = {"data": {"format": "preference"}, "training": {"objective": "dpo", "micro_batch_size": PAIRS,
                                                          "max_steps": 4, "logging_steps": 1}}
    return load_recipe(causal_recipe(tmp_path, path, **merge(base, sections)))


@pytest.mark.parametrize("precompute", [False, True])
def test_the_estimate_is_the_counted_trainer_step(precompute: bool, tmp_path: Path, tokenizer: Any) -> None:
    """With ``training.dpo_precompute_ref`` the batch also carries the reference log-probs (two
    float32 per pair, no forward argument either) and the step runs no reference forward."""
    cfg = _recipe(tmp_path, training={"dpo_precompute_ref": precompute})
    rows = prepare_data(cfg, tokenizer).rows(cfg)
    assert (rows.longest, rows.uniform) == (LONGEST, False)  # [CLS] + 6 + 8 + [SEP]; rejected shorter
    predicted = estimate(cfg, rows=rows, device="cpu")
    counter = trainer_steps()
    result = train(cfg, console=Console(quiet=True), callbacks=[counter])
    assert list(result.model.peft_config) == ["default"]  # the reference: adapter disabled, no copy
    steady = [s for s in counter.steps if s["step"] >= 2]
    assert len({s["peak"] for s in steady}) == 1, counter.steps
    completion_mask = 2 * PAIRS * LONGEST * 8
    assert max(s["inputs"] for s in steady) == 2 * completion_mask  # input_ids, attention_mask
    unseen = completion_mask + (2 * PAIRS * 4 if precompute else 0)
    counted = steady[0]["peak"]
    print(f"dpo: predicted {predicted.peak_bytes:,} counted {counted:,}")
    assert counted == predicted.peak_bytes - unseen, counter.steps  # accelerate's loss copy: both hold it
    margins = [h["rewards/margins"] for h in result.log_history if "rewards/margins" in h]
    assert margins[0] == 0 and margins[-1] > 0  # the policy starts as the reference, then moves


def test_recovery_splits_pairs_and_keeps_the_losses(tmp_path: Path) -> None:
    """A budget between the half and the whole micro-batch: every step is split into two halves of
    two pairs each, and the losses are those of the run without a budget. The memory report of each
    run compares like with like: the batch in pairs (TRL stacks 2 rows per pair), the split's pieces
    accumulated, the step redone after the out-of-memory error left out (it also holds the failed
    attempt). Planted, each fails: rows counted instead of pairs; the split ignored; the redone step
    reported; the pieces' accumulation left out of the second prediction (-0.05%: LoRA's gradients)."""
    plain = train(_recipe(tmp_path / "plain", output={"report": True}), console=Console(quiet=True))
    budgeted = train(_recipe(tmp_path / "split", memory={"simulate_budget": "110MiB"},
                             output={"report": True}), console=Console(quiet=True))
    losses = [[h["loss"] for h in run.log_history if "loss" in h] for run in (plain, budgeted)]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-4)
    recovered = [h["memory/recovered_micro_batch"] for h in budgeted.log_history
                 if "memory/recovered_micro_batch" in h]
    assert recovered == [PAIRS // 2], budgeted.log_history  # in pairs: 4 -> 2
    # the memory report measures in the recipe's units, pairs, and in the pieces the split ran:
    # compared with the prediction for 2 pairs accumulated twice, not the 4 pairs (or 8 rows) fetched
    assert (plain.memory.batch, plain.memory.accumulation) == ((PAIRS, LONGEST), 1)
    assert (budgeted.memory.batch, budgeted.memory.accumulation) == ((PAIRS // 2, LONGEST), 2)
    for run in (plain, budgeted):
        report = load_report(run.output_dir)
        ratio = report.compared()["peak_bytes"] / report.measured["peak_bytes"]
        assert ratio == pytest.approx(1, abs=1e-4), (comparison(report), report.same_batch)


def test_the_planner_decides_the_dpo_fields(tmp_path: Path) -> None:
    """`auto` for DPO: only a LoRA adapter and the standard loss are candidates (TRL's head replaces
    the model's loss; the reference is the adapter-disabled base), and precomputing the reference
    log-probs is chosen: the same peak (plus the batch's reference log-probs, two float32 per pair),
    one forward less per step."""
    from memtrain.plan import planner

    cfg = _recipe(tmp_path, memory={"budget": "2GiB", "loss": "auto"},
                  adapter={"method": "auto"}, training={"dpo_precompute_ref": "auto"})
    plan = planner.plan(cfg)
    assert plan.chosen.values == {"adapter.method": "lora", "memory.loss": "standard",
                                  "training.dpo_precompute_ref": True}, plan.chosen
    # without precomputing: traced and slower, or not traced, its bound already over the choice's time
    others = [c for c in plan.alternatives + plan.rejected
              if c.values["training.dpo_precompute_ref"] is False]
    assert others and all(c.reason.startswith("slower") for c in others), others
    assert all(c.seconds > plan.chosen.seconds for c in plan.alternatives), plan.alternatives
    live = estimate(planner.with_values(cfg, {**plan.chosen.values, "training.dpo_precompute_ref": False}))
    assert live.total_bytes + 2 * PAIRS * 4 == plan.chosen.peak


def test_auto_fit_probes_the_dpo_step_and_leaves_no_metrics_behind(tmp_path: Path) -> None:
    """`micro_batch_size: auto`: the probe steps run the Trainer's own DPO loss (the model's forward
    alone returns no loss) and what TRL's metrics collected during them is dropped: the first
    logged token count is that of the first batch (4 chosen rows of 16 tokens, rejected rows of
    13 to 16)."""
    cfg = _recipe(tmp_path, training={"micro_batch_size": "auto", "effective_batch_size": PAIRS,
                                      "max_steps": 1}, memory={"budget": "2GiB"})
    result = train(cfg, console=Console(quiet=True))
    assert result.batch.micro == PAIRS
    first = next(h for h in result.log_history if "num_tokens" in h)
    assert first["num_tokens"] == PAIRS * LONGEST + sum(13 + i for i in range(PAIRS))
