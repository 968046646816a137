"""Out-of-memory recovery in a GRPO run (issue 38, item 4): the micro-batch of completions TRL
generated is split and its optimizer step redone on the same completions, never generating again.

GRPO normalises rewards within each prompt's group when it generates, before the generation batch is
shuffled into micro-batches, so every completion carries its advantage; what the split must respect
is how each loss type averages a micro-batch (:class:`memtrain.reliability.layouts.Completions`).

Equivalence: ``memtrain train`` of recipes/tiny-llama-grpo.yaml with an out-of-memory error injected
in the backward of the *second* micro-batch of the first optimizer step (so the first is replayed
too) gives the gradients, the parameters and the logged losses of the same run without it, for a
loss averaged per completion (``grpo``), per token (``bnpo``) and over the generation batch
(``dapo``). Unit: the pieces' weights by loss type, and the batches that must not be split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from plain_trainer import GradCapture, max_grad_difference
from transformers import TrainerCallback

from memtrain.config import load_recipe, shipped_recipes_dir
from memtrain.reliability.layouts import Completions, Unsplittable, layout_of

trl = pytest.importorskip("trl")

RECIPE = shipped_recipes_dir() / "tiny-llama-grpo.yaml"


class FailOnce(TrainerCallback):
    """Raise torch's out-of-memory error once, in the backward of training micro-batch ``at`` (1-based)
    with more than ``rows_over`` completions, after the later layer's gradients were added."""

    def __init__(self, at: int, rows_over: int) -> None:
        self.at, self.rows_over = at, rows_over
        self.backwards = 0
        self.raised: list[int] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        layer = model.model.layers[0].mlp

        def fail(module: Any, grad_in: Any, grad_out: Any) -> None:
            rows = int(grad_out[0].shape[0])
            self.backwards += 1
            if rows > self.rows_over and self.backwards == self.at and not self.raised:
                self.raised.append(rows)
                raise torch.OutOfMemoryError(f"injected: {rows} completions do not fit")

        layer.register_full_backward_hook(fail)


def run(tmp_path: Path, loss: str, fail: TrainerCallback | None, micro: int = 16, accumulation: int = 2
        ) -> tuple[Any, GradCapture]:
    from memtrain.run.train import train

    cfg = load_recipe(RECIPE, [f"output.dir={tmp_path}", "training.max_steps=2", "training.logging_steps=1",
                               f"training.micro_batch_size={micro}",
                               f"training.gradient_accumulation={accumulation}",
                               f"training.grpo_loss={loss}",
                               "training.optimizer=sgd", "training.learning_rate=1e-3",
                               "training.max_grad_norm=null",  # clipping would hide a scaled gradient
                               "data.max_examples=64"])
    capture = GradCapture()
    result = train(cfg, callbacks=[capture, *([fail] if fail else [])])
    return result, capture


@pytest.mark.slow
# CI's long leg; in the suite: each loss type's share of a split step
# (test_pieces_carry_their_share_of_each_loss_type) and a GRPO step redone on the same completions
# (tests/plugin/test_grpo_plugin.py::test_an_out_of_memory_grpo_step_is_redone_on_the_same_completions)
@pytest.mark.long
@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dapo"])
def test_a_recovered_grpo_step_equals_the_unsplit_step(tmp_path: Path, loss: str) -> None:
    ref, ref_grads = run(tmp_path / "ref", loss, None)
    fail = FailOnce(at=2, rows_over=8)
    rec, rec_grads = run(tmp_path / "rec", loss, fail)
    assert fail.raised == [16]  # the second micro-batch of 16 completions failed once; halves fit
    logged = [e for e in rec.log_history if "memory/recovered_micro_batch" in e]
    assert [(e["step"], e["memory/recovered_micro_batch"], e["memory/recovered_accumulation"])
            for e in logged] == [(1, 8, 4)], rec.log_history
    assert len(rec_grads.grads) == len(ref_grads.grads) == 2  # no optimizer step lost or added
    # the rewards differ within groups (else every advantage, and gradient, would be 0)
    assert all(max(float(g.abs().max()) for g in step.values()) > 1e-3 for step in ref_grads.grads)
    for ref_step, rec_step in zip(ref_grads.grads, rec_grads.grads, strict=True):
        assert max_grad_difference(ref_step, rec_step) < 1e-4
    for key in ("loss", "reward"):  # each micro-batch counted once; the same completions were scored
        ref_values = [e[key] for e in ref.log_history if key in e]
        rec_values = [e[key] for e in rec.log_history if key in e]
        assert len(rec_values) == len(ref_values) == 2, (key, rec.log_history)
        assert rec_values == pytest.approx(ref_values, rel=1e-4, abs=1e-7), key


class _Args:
    def __init__(self, loss_type: str, **more: Any) -> None:
        self.loss_type, self.top_entropy_quantile, self.entropy_coef = loss_type, 1.0, 0.0
        self.use_adaptive_entropy = False
        self.__dict__.update(more)


def _trainer(loss_type: str, **more: Any) -> Any:
    trainer = trl.GRPOTrainer.__new__(trl.GRPOTrainer)  # a GRPOTrainer's type and arguments, no model
    trainer.args = _Args(loss_type, **more)
    return trainer


def _batch() -> dict[str, Any]:
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]])  # 4, 3, 1, 1 tokens
    return {"prompt_ids": torch.zeros(4, 3, dtype=torch.long), "prompt_mask": torch.ones(4, 3),
            "completion_ids": torch.zeros(4, 4, dtype=torch.long), "completion_mask": mask,
            "advantages": torch.arange(4.0), "num_items_in_batch": torch.tensor(40.0)}


@pytest.mark.parametrize(("loss_type", "shares"), [
    ("grpo", [0.5, 0.5]), ("dr_grpo", [0.5, 0.5]),  # a mean of per-completion means; rows x length
    ("bnpo", [7 / 9, 2 / 9]),  # a mean over the micro-batch's completion tokens: 4 + 3, then 1 + 1 of 9
    ("dapo", [1.0, 1.0]),  # a sum over the generation batch's tokens: pieces add up
])
def test_pieces_carry_their_share_of_each_loss_type(loss_type: str, shares: list[float]) -> None:
    batch = _batch()
    layout = layout_of(_trainer(loss_type), batch)
    assert isinstance(layout, Completions) and layout.count == 4 and layout.unit == "completion"
    pieces = layout.split(2)
    assert [layout.share(p) for p in pieces] == pytest.approx(shares)
    assert pieces[0]["num_items_in_batch"] is batch["num_items_in_batch"]  # shared, not cut
    assert torch.equal(pieces[1]["advantages"], torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize(("more", "batch_change", "reason"), [
    ({"top_entropy_quantile": 0.2}, {}, "highest-entropy tokens of the whole micro-batch"),
    ({"entropy_coef": 0.01}, {}, "entropy bonus"),
    ({"use_adaptive_entropy": True}, {}, "entropy bonus"),
    ({}, {"pixel_values": torch.zeros(7, 3)}, "`pixel_values` has 7 rows"),
    ({}, {"num_images": [1, 1, 1, 1]}, "`num_images` is a list"),
])
def test_coupled_grpo_batches_are_not_split(more: dict[str, Any], batch_change: dict[str, Any],
                                            reason: str) -> None:
    layout = layout_of(_trainer("dapo", **more), {**_batch(), **batch_change})
    assert isinstance(layout, Unsplittable) and reason in (layout.refusal or ""), layout.refusal
    assert layout.unit == "completion" and layout.count == 4


def test_an_unknown_loss_type_is_not_split() -> None:
    layout = layout_of(_trainer("some_future_loss"), _batch())
    assert isinstance(layout, Unsplittable) and "'some_future_loss'" in (layout.refusal or "")


class FailGenerating(TrainerCallback):
    """Raise torch's out-of-memory error in a generation forward (no gradient) holding more than
    ``rows_over`` rows: once, or (``always``) every time."""

    def __init__(self, rows_over: int, always: bool = False) -> None:
        self.rows_over, self.always = rows_over, always
        self.raised: list[int] = []
        self.generated: list[int] = []  # rows of every generation forward that ran
        self.trained: list[int] = []  # rows of every training forward

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        def fail(module: Any, inputs: Any, out: Any) -> None:
            if torch.is_grad_enabled():
                self.trained.append(int(out.shape[0]))
                return
            rows = int(out.shape[0])
            if rows > self.rows_over and (self.always or not self.raised):
                self.raised.append(rows)
                raise torch.OutOfMemoryError(f"injected: generating {rows} completions does not fit")
            self.generated.append(rows)

        model.model.layers[0].mlp.register_forward_hook(fail)


@pytest.mark.slow
def test_generation_out_of_memory_generates_fewer_prompts_per_call(tmp_path: Path) -> None:
    """24 completions per step (3 prompts x 8, one micro-batch) generated in one ``generate`` call run
    out of memory once; they are generated again in two calls of whole groups, 1 and 2 prompts' (8
    and 16 completions), and so for the rest of the run: every step still trains 24 completions, 8
    per prompt, and logs its rewards. Planted: calls cut by rows (12 and 12, mid-group) -> fails."""
    fail = FailGenerating(rows_over=16)
    result, capture = run(tmp_path, "dapo", fail, micro=24, accumulation=1)
    assert fail.raised == [24]
    assert fail.generated and set(fail.generated) == {8, 16}, fail.generated  # whole groups per call
    assert fail.trained == [24, 24]  # each step trains the completions of every prompt
    logged = [e for e in result.log_history if "memory/recovered_generation_prompts" in e]
    assert [(e["step"], e["memory/recovered_generation_prompts"]) for e in logged] == [(1, 2)]
    assert len(capture.grads) == 2  # both optimizer steps ran
    rewards = [e for e in result.log_history if "reward" in e]
    assert len(rewards) == 2 and all(e["num_tokens"] > 0 for e in rewards), result.log_history


@pytest.mark.slow
def test_a_group_that_cannot_be_generated_stops_with_what_to_lower(tmp_path: Path) -> None:
    from memtrain.reliability.generation import GroupTooLarge

    with pytest.raises(GroupTooLarge, match="num_generations") as caught:
        run(tmp_path, "dapo", FailGenerating(rows_over=4, always=True))
    assert "max_completion_length" in str(caught.value) and "8 completions" in str(caught.value)


def test_generation_calls_are_joined_in_order_padded_on_the_right() -> None:
    """The calls' outputs keep the rows' order; a shorter call (every row of it ended early) is padded
    with the pad token after its end, which TRL masks. A call that fails is redone in halves."""
    from types import SimpleNamespace

    from memtrain.reliability.generation import GenerationRecovery

    calls: list[int] = []

    class Model(torch.nn.Module):
        generation_config = SimpleNamespace(pad_token_id=7, eos_token_id=2)

        def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> torch.Tensor:
            calls.append(int(input_ids.shape[0]))
            if input_ids.shape[0] > 4:
                raise torch.OutOfMemoryError("injected")
            new = 1 + int(input_ids[0, 0]) // 4  # the first group's rows end after 1 token, the second's 2
            return torch.cat([input_ids, input_ids[:, :1].expand(-1, new) + 100], dim=1)

    state = SimpleNamespace(global_step=0, log_history=[], epoch=None)
    trainer = SimpleNamespace(model=Model(), state=state, args=None, control=None,
                              callback_handler=SimpleNamespace(on_log=lambda *a: None))
    recovery = GenerationRecovery(trainer, group=4).install()
    ids = torch.arange(8).unsqueeze(1)  # 2 prompts x 4 completions, a 1-token prompt each
    out = trainer.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert calls == [8, 4, 4] and recovery.events[0]["prompts"] == 1
    assert out[:, 0].tolist() == list(range(8))  # rows in order
    assert out[:4, 1:].tolist() == [[100, 7], [101, 7], [102, 7], [103, 7]]  # padded after its end
    assert out[4:, 1:].tolist() == [[104, 104], [105, 105], [106, 106], [107, 107]]
