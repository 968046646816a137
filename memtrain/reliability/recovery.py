"""Out-of-memory recovery in the middle of training: halve the micro-batch, redo the same step.

When a forward or backward of a micro-batch raises ``torch.OutOfMemoryError`` (CUDA's, or the
simulated one of :class:`memtrain.reliability.budget.SimulatedBudget`) or the ``RuntimeError`` of a
failed CPU allocation (:func:`is_out_of_memory`), :class:`MicroBatchRecovery`
frees what the failed attempt held, sets every gradient of the model to None and replays *this
optimizer step's* micro-batches from the start, each split in two (accumulation doubles, the
effective batch is unchanged). The optimizer, its state and the learning-rate schedule are never
touched, and nothing restarts: the Trainer's loop does not even notice. The split is kept for the
rest of the run; a further out-of-memory error halves again, down to one example per forward.

Why replay instead of continuing: a backward that failed half-way has already added into some
``.grad`` tensors, and which ones is unknown, so the only exact repair is to drop all gradients
of the step and recompute them. The inputs of the step's earlier micro-batches are token ids the
Trainer already holds in memory (it fetches a whole step's micro-batches before the first
forward), so keeping references to them costs nothing.

Why the split is exact. The Trainer's loss for a micro-batch is either normalized by the token
(or label) count of the *whole optimizer step*, ``num_items_in_batch`` (causal LMs in
transformers 5: sum of token losses / tokens in the step), which is additive over pieces, or a
mean over the micro-batch's own items (sequence classification: the model ignores
``num_items_in_batch``), which is not. For a mean, each piece's loss is weighted by its share of
the micro-batch's items (labels other than -100, shifted for causal losses, as the Trainer counts
them), so the pieces' gradients add up to the unsplit one. Which kind of loss a model computes is
found once, on the first split, by computing a piece's loss (no gradient) with two different
``num_items_in_batch``. The Trainer's own scaling for gradient accumulation is left as it is.
With dropout, a replayed micro-batch draws new masks: the same distribution, not the same bits.

Where a batch may be cut is its layout's business (:mod:`memtrain.reliability.layouts`, an ordered
list of detectors): rows for a plain batch; whole preference pairs for TRL's stacked
``[chosen; rejected]`` batches (with per-pair extras such as ``ref_chosen_logps`` split with their
pairs); sequence boundaries for a padding-free packed row; completions for TRL's GRPO, whose micro-batch is
generated once, before the first attempt, so that every attempt and replay trains on the same
completions (:class:`memtrain._compat.trl.GenerationSteps`). A batch whose loss or tensors couple its
examples is refused with :class:`UnsplittableBatch`, naming the trainer and what to change
(:class:`Fixes`: in recipe terms for ``memtrain train``, in ``TrainingArguments`` terms for the
plugin). Micro-batch sizes in the log and the events are in the layout's units (examples,
preference pairs, packed sequences).

What a replay must not do twice. The failed attempt is let go of completely: its gradients are
dropped, and the backward hooks memtrain's trackers (meter, simulated budget) put on its graph are
removed (:meth:`memtrain.memory.trackers.ReleasableModTracker.release`; without that, a failed
forward kept its whole graph alive and every smaller retry failed at the same limit). The
trainer's own metric side effects of a step (TRL's ``_metrics`` lists and its ``num_tokens``
count, :data:`memtrain.reliability.replay.SIDE_EFFECTS`) are put back as they were when the
optimizer step began before the step is replayed, so every micro-batch is counted once; the loss
returned to the Trainer's loop is that of the current micro-batch only. The recovery's own log
entry bypasses the trainer's ``log`` (TRL's flushes its metrics there) and is stamped with the
optimizer step being redone.

Evaluation batches are split the same way by :class:`memtrain.reliability.eval_recovery.EvalBatchRecovery`.

Several processes redo the step together. After every micro-batch each process says whether it
went over its budget (one all-reduce, :func:`memtrain.distributed.together.flagged_ranks`); if any did, all of
them free, split and replay the same micro-batches, so their collectives keep matching and the
effective batch is unchanged. What a process can report is what memtrain's budget guard noted
without stopping the step: :class:`~memtrain.reliability.budget.SimulatedBudget` defers with several
processes (``memory.simulate_budget``). An allocator's own out-of-memory error in one process in
the middle of a step cannot be redone together: the others are already waiting in a collective
(an FSDP all-gather or reduce-scatter, DDP's all-reduce) that process left behind, so the run stops
with that error (:class:`OutOfMemoryInOneProcess`; on CPU the others fail as soon as its
connections close, on CUDA at NCCL's timeout).

Limits: an out-of-memory error in ``optimizer.step`` is not a micro-batch problem and is not
handled here.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain._compat.transformers_trainer import prepare_inputs
from memtrain._compat.trl import generation_steps
from memtrain.config import RunConfig
from memtrain.distributed.together import drop_gradients, flagged_ranks, world
from memtrain.errors import MemtrainError
from memtrain.reliability.generation import GenerationRecovery
from memtrain.reliability.layouts import Layout, count_items, layout_of
from memtrain.reliability.oom import free_memory, is_out_of_memory
from memtrain.reliability.replay import log_entry, restore_effects, snapshot_effects
from memtrain.units import format_bytes

log = logging.getLogger(__name__)

StepFn = Callable[[nn.Module, dict[str, Any], Any], torch.Tensor]


class MicroBatchTooLarge(torch.OutOfMemoryError, MemtrainError):
    """Out of memory with one example per forward: no split can help. Says what is needed."""


class UnsplittableBatch(MicroBatchTooLarge):
    """Out of memory with a batch whose layout may not be cut (:mod:`memtrain.reliability.layouts`)."""


class OutOfMemoryInOneProcess(torch.OutOfMemoryError, MemtrainError):
    """An allocation failed in one of several processes in the middle of a step (not recoverable)."""


@dataclass(frozen=True)
class Fixes:
    """What the messages tell a user to change, in the terms of how they run memtrain."""

    one_example: str = ("a larger `memory.budget` (or a larger GPU), `memory.checkpointing: full`, a shorter "
                        "`data.max_length`, LoRA or quantization")
    micro_batch: str = ("`training.micro_batch_size: auto` with `memory.budget` (it probes what fits), or a "
                        "smaller `training.micro_batch_size`, or the memory savings of `memtrain plan`")

    @classmethod
    def for_recipe(cls, cfg: RunConfig) -> Fixes:
        """A recipe's fixes (:func:`memory_fixes`), for one example that does not fit."""
        return cls(one_example=memory_fixes(cfg, micro_batch=False))


def memory_fixes(cfg: RunConfig, *, micro_batch: bool = True) -> str:
    """What can make the recipe's step fit, leaving out what it does already (``micro_batch``: the
    micro-batch may still shrink)."""
    m, t = cfg.memory, cfg.training
    fixes = [f"a larger `{m.budget_field}`" + ("" if m.simulate_budget is not None else " (a larger GPU)")]
    if micro_batch and t.micro_batch_size != 1:
        fixes.append("a smaller `training.micro_batch_size` (`auto` probes what fits)")
    if m.checkpointing != "full":
        fixes.append("`memory.checkpointing: full`")
    fixes.append("a shorter `data.max_length`")
    if cfg.adapter.method == "full":
        fixes.append("LoRA (`adapter.method: lora`)")
    elif cfg.model.quantization == "none":
        fixes.append("QLoRA (`model.quantization: nf4`)")
    return ", ".join(fixes) + ", or the settings `memtrain plan` chooses for fields set to `auto`"


_RECOVERIES: weakref.WeakKeyDictionary[Any, MicroBatchRecovery] = weakref.WeakKeyDictionary()


def recovery_of(trainer: Any) -> MicroBatchRecovery | None:
    """The :class:`MicroBatchRecovery` made for ``trainer`` last, if any (memtrain's Trainer and
    the plugin's ``attach`` each make one)."""
    try:
        return _RECOVERIES.get(trainer)
    except TypeError:  # not weakly referenceable: no recovery was made for it
        return None


class MicroBatchRecovery:
    """Wrap a Trainer's ``training_step`` so that an out-of-memory micro-batch is split and redone.

    Args:
        trainer: the ``transformers.Trainer`` whose steps to protect.
        step_fn: the step to run on each piece, ``(model, inputs, num_items_in_batch) -> loss``
            (default: the trainer's ``training_step`` as it is when this object is created).
        budget_bytes: the budget the run has, for the message when nothing fits (optional).
        fixes: what the messages suggest changing (default: recipe fields of ``memtrain train``).
    """

    def __init__(self, trainer: Any, step_fn: StepFn | None = None, budget_bytes: int | None = None,
                 fixes: Fixes | None = None) -> None:
        self.trainer = trainer
        self.step_fn: StepFn = step_fn or trainer.training_step
        self.budget_bytes = budget_bytes
        self.fixes = fixes or Fixes()
        self.parts = 1  # pieces each micro-batch from the data loader is split into
        _RECOVERIES[trainer] = self
        self.events: list[dict[str, Any]] = []  # one per recovery, for reports and tests
        self._loss_is_mean: bool | None = None  # found on the first split
        self._over: list[int] = []  # several processes: the ranks that went over budget last time
        self._step: int | None = None
        self._state: Any = None
        self._done: list[dict[str, Any]] = []  # inputs of this optimizer step's finished micro-batches
        self._effects: dict[str, Any] = {}  # SIDE_EFFECTS as they were when this optimizer step began
        # TRL's GRPOTrainer: generation first, once per micro-batch; every attempt trains on its output
        self.generation = generation_steps(trainer)
        # and while it generates: fewer prompts per `generate` call (memtrain.reliability.generation)
        self.generation_recovery = (GenerationRecovery(trainer, trainer.args.num_generations).install()
                                    if self.generation is not None else None)

    def install(self) -> MicroBatchRecovery:
        """Make the trainer run its steps through :meth:`training_step` (an instance attribute)."""
        self.trainer.training_step = self.training_step
        return self

    # ----------------------------------------------------------------------------- the step

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's ``training_step``, recovering from out-of-memory errors (same signature)."""
        state = self.trainer.state  # a new object when a training loop (re)starts
        step = state.global_step
        if self.generation is not None:  # before the snapshot: a generation's metrics are the step's own
            inputs = self.generation.prepare(inputs)
        if step != self._step or state is not self._state:  # a new optimizer step: forget the last one's
            self._state, self._step, self._done = state, step, []
            self._effects = snapshot_effects(self.trainer)
        replay = False
        while True:
            try:
                if replay:
                    restore_effects(self.trainer, self._effects)  # each micro-batch counted once
                    for earlier in self._done:  # their losses were already counted by the Trainer
                        self._run_pieces(model, earlier, num_items_in_batch)
                loss = self._run_pieces(model, inputs, num_items_in_batch)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if isinstance(err, MicroBatchTooLarge) or not is_out_of_memory(err):
                    raise
                message = str(err)
                if world()[1] > 1:
                    raise self._in_one_process(message) from None
            else:
                message = self._overrun_anywhere(inputs)
                if message is None:
                    break
            # Outside the except block the traceback, and the activations its frames hold, are gone.
            self._shrink(model, inputs, message)
            replay = True
        self._done.append(inputs)
        if self.generation is not None:
            self.generation.advance()
        return loss

    def _overrun_anywhere(self, inputs: dict[str, Any]) -> str | None:
        """With several processes and a deferring budget: what went over budget in any process
        during this micro-batch (a collective: every process, after every micro-batch)."""
        sources = [cb for cb in self.trainer.callback_handler.callbacks if hasattr(cb, "take_overrun")]
        if not sources or world()[1] == 1:
            return None
        notes = [note for note in (cb.take_overrun() for cb in sources) if note]
        device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), "cpu")
        ranks = self._over = flagged_ranks(bool(notes), device)
        if not ranks:
            return None
        mine = notes[0] if notes else "another process went over its budget"
        return f"process(es) {ranks} of {world()[1]} went over the budget: {mine}"

    def _in_one_process(self, message: str) -> OutOfMemoryInOneProcess:
        rank, size = world()
        step = self.trainer.state.global_step + 1
        return OutOfMemoryInOneProcess(
            f"Out of memory in process {rank} of {size} in the middle of optimizer step {step}: "
            f"{message.splitlines()[0] if message else ''} The processes cannot redo the step together: "
            f"the others wait in a collective this one left behind. Fix: {self.fixes.micro_batch}.")

    def micro_batch(self, units: int) -> int:
        """The largest piece a micro-batch of ``units`` (examples, pairs, ...) is split into now."""
        return math.ceil(units / min(self.parts, units))

    def _run_pieces(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        layout = layout_of(self.trainer, inputs) if self.parts > 1 else None
        if layout is None or layout.refusal or layout.count <= 1:  # whole: refused only if it fails
            return self._step_fn(model, inputs, num_items_in_batch)
        pieces = layout.split(self.parts)
        shares = [layout.share(piece) for piece in pieces]
        known = all(share is not None for share in shares)  # the layout knows how the loss averages
        if self._loss_is_mean is None and not known:
            self._loss_is_mean = self._detect_mean_loss(model, pieces[0], num_items_in_batch)
        # A mean over no items is NaN split or not: then run the pieces unweighted.
        total_items = (count_items(self.trainer, inputs, layout) or None) if self._loss_is_mean else None
        loss: torch.Tensor | None = None
        for piece, share in zip(pieces, shares, strict=True):
            weight = 1.0
            if known:
                if share == 0:
                    continue  # nothing of the loss in it (no completion tokens of a token mean)
                weight = float(share)  # type: ignore[arg-type]
            elif total_items is not None:
                items = count_items(self.trainer, piece)
                if items == 0:
                    continue  # an empty piece adds nothing to a mean (and its own mean is NaN)
                weight = items / total_items
            part = self._weighted_step(model, piece, num_items_in_batch, weight)
            loss = part if loss is None else loss + part
        if loss is None:  # unreachable: some piece holds the micro-batch's items
            raise RuntimeError("no piece of the micro-batch ran")
        return loss

    def _step_fn(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """The trainer's step on ``inputs`` (for GRPO: on the completions already generated)."""
        if self.generation is not None:
            return self.generation.step(self.step_fn, model, inputs, num_items_in_batch)
        return self.step_fn(model, inputs, num_items_in_batch)

    def _weighted_step(self, model: nn.Module, piece: dict[str, Any], num_items_in_batch: Any,
                       weight: float) -> torch.Tensor:
        if weight == 1.0:
            return self._step_fn(model, piece, num_items_in_batch)
        trainer = self.trainer
        own = trainer.__dict__.get("compute_loss")
        inner = trainer.compute_loss

        def weighted(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if isinstance(out, tuple):
                return (out[0] * weight, *out[1:])
            return out * weight

        trainer.compute_loss = weighted  # the stock training_step calls self.compute_loss
        try:
            return self._step_fn(model, piece, num_items_in_batch)
        finally:
            if own is None:
                del trainer.compute_loss
            else:
                trainer.compute_loss = own

    # -------------------------------------------------------------------------- on failure

    def _shrink(self, model: nn.Module, inputs: dict[str, Any], message: str) -> None:
        """Free memory, double the split, and say so; raise when the batch cannot be split further."""
        release_failed_attempt(model)
        layout = layout_of(self.trainer, inputs)
        before = self.micro_batch(layout.count)
        if before <= 1:
            raise MicroBatchTooLarge(self._too_large(inputs, layout, message))
        if layout.refusal:
            raise self._unsplittable(layout, before, message)
        self.parts = min(self.parts * 2, layout.count)
        after = self.micro_batch(layout.count)
        accumulation = self.trainer.args.gradient_accumulation_steps * self.parts
        step = self.trainer.state.global_step + 1
        log.warning("Out of memory in optimizer step %d with micro-batch %d (%ss): freed memory, redoing the "
                    "same step with micro-batch %d and %d accumulated (effective batch unchanged; "
                    "optimizer and scheduler state untouched). First line of the error: %s", step, before,
                    layout.unit, after, accumulation, message.splitlines()[0] if message else "")
        event: dict[str, Any] = {"step": step, "micro_batch_before": before, "micro_batch": after,
                                 "accumulation": accumulation, "unit": layout.unit}
        if self._over:  # several processes: which of them went over the budget
            event["processes_over_budget"] = list(self._over)
        self.events.append(event)
        log_entry(self.trainer, {"memory/recovered_micro_batch": float(after),
                                 "memory/recovered_accumulation": float(accumulation)})

    def _unsplittable(self, layout: Layout, before: int, message: str) -> UnsplittableBatch:
        name = type(self.trainer).__name__
        step = self.trainer.state.global_step + 1
        text = (f"Out of memory in optimizer step {step} with a micro-batch of {before} {layout.unit}s, "
                f"and {name}'s batch cannot be split for recovery: {layout.refusal}. "
                f"Fix: {self.fixes.micro_batch}.\nThe error was: {message}")
        log.warning("%s", text.splitlines()[0])
        return UnsplittableBatch(text)

    def _too_large(self, inputs: dict[str, Any], layout: Layout, message: str) -> str:
        ids = inputs.get("input_ids")
        length = f" of {ids.shape[-1]} tokens" if isinstance(ids, torch.Tensor) else ""
        have = (f"the budget of {format_bytes(self.budget_bytes)}" if self.budget_bytes
                else "the memory there is")
        peak = device_peak_bytes(inputs)
        needed = f" (the step had reached {format_bytes(peak)} when it failed)" if peak else ""
        return (f"Out of memory with a micro-batch of 1 {layout.unit}{length}: one {layout.unit}'s step "
                f"needs more than {have}{needed}. Fix: {self.fixes.one_example}.\nThe error was: {message}")

    def _detect_mean_loss(self, model: nn.Module, piece: dict[str, Any], num_items_in_batch: Any) -> bool:
        """Whether the loss is a mean over its own micro-batch (True) or normalized by the step's items."""
        if num_items_in_batch is None:
            return True
        trainer = self.trainer
        was_training = model.training
        effects = snapshot_effects(trainer)  # these two extra losses are not part of training
        model.eval()  # no dropout: the two losses differ only by their normalization
        try:
            with torch.no_grad():
                prepared = prepare_inputs(trainer, piece)
                one = trainer.compute_loss(model, dict(prepared), num_items_in_batch=num_items_in_batch)
                two = trainer.compute_loss(model, dict(prepared), num_items_in_batch=2 * num_items_in_batch)
        finally:
            model.train(was_training)
            restore_effects(trainer, effects)
        one, two = float(one.detach().float().mean()), float(two.detach().float().mean())
        if math.isclose(one, two, rel_tol=1e-4, abs_tol=1e-12):
            return True
        if math.isclose(one, 2 * two, rel_tol=1e-4, abs_tol=1e-12):
            return False
        raise MemtrainError(
            "Out-of-memory recovery cannot split this micro-batch exactly: the loss is neither a mean over "
            f"the micro-batch nor normalized by `num_items_in_batch` ({one:.6g} vs {two:.6g} with twice the "
            f"items). Fix: {self.fixes.micro_batch}, or a loss of one of those two kinds.")


# --------------------------------------------------------------------------------- helpers

def release_failed_attempt(model: nn.Module) -> None:
    """Let go of all a failed forward or backward held: the gradients it may have added into, the
    backward hooks memtrain's trackers put on its graph (they kept the graph, and every activation
    saved in it, alive), then garbage and the device's cached blocks."""
    drop_gradients(model)
    reset_module_tracking()
    free_memory()


def reset_module_tracking() -> None:
    """Let go of a failed forward or backward in the active memory trackers.

    memtrain's trackers (meter, simulated budget) remove the backward hooks they put on the failed
    pass's graph, which otherwise keep the graph and its activations alive
    (:class:`memtrain._compat.torch_trackers.ReleasableModTracker`). In every tracker, the modules
    the pass left "running" are forgotten: torch's ``ModTracker`` pops a module when its forward or
    backward ends, and one interrupted by an exception would make the next step's phases (forward /
    backward / optimizer) and recompute regions be misread
    (:func:`memtrain._compat.torch_trackers.release_module_tracking`).
    """
    from memtrain._compat.torch_trackers import release_module_tracking

    release_module_tracking()


def device_peak_bytes(inputs: dict[str, Any]) -> int | None:
    """The CUDA allocator's peak on the batch's device since the last reset, else None."""
    device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), None)
    if device is None or device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


