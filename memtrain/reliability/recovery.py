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

import gc
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtrain.device import cuda_available
from memtrain.distributed.together import drop_gradients, flagged_ranks, world
from memtrain.errors import MemtrainError
from memtrain.units import format_bytes

log = logging.getLogger(__name__)

StepFn = Callable[[nn.Module, dict[str, Any], Any], torch.Tensor]


class MicroBatchTooLarge(torch.OutOfMemoryError, MemtrainError):
    """Out of memory with one example per forward: no split can help. Says what is needed."""


class OutOfMemoryInOneProcess(torch.OutOfMemoryError, MemtrainError):
    """An allocation failed in one of several processes in the middle of a step (not recoverable)."""


class MicroBatchRecovery:
    """Wrap a Trainer's ``training_step`` so that an out-of-memory micro-batch is split and redone.

    Args:
        trainer: the ``transformers.Trainer`` whose steps to protect.
        step_fn: the step to run on each piece, ``(model, inputs, num_items_in_batch) -> loss``
            (default: the trainer's ``training_step`` as it is when this object is created).
        budget_bytes: the budget the run has, for the message when nothing fits (optional).
    """

    def __init__(self, trainer: Any, step_fn: StepFn | None = None, budget_bytes: int | None = None) -> None:
        self.trainer = trainer
        self.step_fn: StepFn = step_fn or trainer.training_step
        self.budget_bytes = budget_bytes
        self.parts = 1  # pieces each micro-batch from the data loader is split into
        self.events: list[dict[str, Any]] = []  # one per recovery, for reports and tests
        self._loss_is_mean: bool | None = None  # found on the first split
        self._over: list[int] = []  # several processes: the ranks that went over budget last time
        self._step: int | None = None
        self._state: Any = None
        self._done: list[dict[str, Any]] = []  # inputs of this optimizer step's finished micro-batches

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
        if step != self._step or state is not self._state:  # a new optimizer step: forget the last one's
            self._state, self._step, self._done = state, step, []
        replay = False
        while True:
            try:
                if replay:
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
            "the others wait in a collective this one left behind. Fix: `training.micro_batch_size: "
            "auto` with `memory.budget` (every process probes, they agree on the micro-batch), or a "
            "smaller `training.micro_batch_size`, or the memory savings of `memtrain plan`.")

    def micro_batch(self, rows: int) -> int:
        """The largest piece a micro-batch of ``rows`` examples is split into now."""
        return math.ceil(rows / min(self.parts, rows))

    def _run_pieces(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        if self.parts == 1:
            return self.step_fn(model, inputs, num_items_in_batch)
        pieces = split_batch(inputs, self.parts)
        if self._loss_is_mean is None:
            self._loss_is_mean = self._detect_mean_loss(model, pieces[0], num_items_in_batch)
        # A mean over no items is NaN split or not: then run the pieces unweighted.
        total_items = (count_items(self.trainer, inputs) or None) if self._loss_is_mean else None
        loss: torch.Tensor | None = None
        for piece in pieces:
            weight = 1.0
            if total_items is not None:
                items = count_items(self.trainer, piece)
                if items == 0:
                    continue  # an empty piece adds nothing to a mean (and its own mean is NaN)
                weight = items / total_items
            part = self._weighted_step(model, piece, num_items_in_batch, weight)
            loss = part if loss is None else loss + part
        if loss is None:  # unreachable: some piece holds the micro-batch's items
            raise RuntimeError("no piece of the micro-batch ran")
        return loss

    def _weighted_step(self, model: nn.Module, piece: dict[str, Any], num_items_in_batch: Any,
                       weight: float) -> torch.Tensor:
        if weight == 1.0:
            return self.step_fn(model, piece, num_items_in_batch)
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
            return self.step_fn(model, piece, num_items_in_batch)
        finally:
            if own is None:
                del trainer.compute_loss
            else:
                trainer.compute_loss = own

    # -------------------------------------------------------------------------- on failure

    def _shrink(self, model: nn.Module, inputs: dict[str, Any], message: str) -> None:
        """Free memory, double the split, and say so; raise when one example does not fit."""
        drop_gradients(model)  # a failed backward may have added into some of them
        free_memory()
        reset_module_tracking()
        rows = batch_rows(inputs)
        before = self.micro_batch(rows)
        if before <= 1:
            raise MicroBatchTooLarge(self._too_large(inputs, message))
        self.parts *= 2
        if self.parts > rows:
            self.parts = rows
        after = self.micro_batch(rows)
        accumulation = self.trainer.args.gradient_accumulation_steps * self.parts
        step = self.trainer.state.global_step + 1
        log.warning("Out of memory in optimizer step %d with micro-batch %d: freed memory, redoing the "
                    "same step with micro-batch %d and %d accumulated (effective batch unchanged; "
                    "optimizer and scheduler state untouched). First line of the error: %s", step, before,
                    after, accumulation, message.splitlines()[0] if message else "")
        event: dict[str, Any] = {"step": step, "micro_batch_before": before, "micro_batch": after,
                                 "accumulation": accumulation}
        if self._over:  # several processes: which of them went over the budget
            event["processes_over_budget"] = list(self._over)
        self.events.append(event)
        self.trainer.log({"memory/recovered_micro_batch": float(after),
                          "memory/recovered_accumulation": float(accumulation)})

    def _too_large(self, inputs: dict[str, Any], message: str) -> str:
        ids = inputs.get("input_ids")
        length = f" of {ids.shape[-1]} tokens" if isinstance(ids, torch.Tensor) else ""
        have = (f"the budget of {format_bytes(self.budget_bytes)}" if self.budget_bytes
                else "the memory there is")
        peak = device_peak_bytes(inputs)
        needed = f" (the step had reached {format_bytes(peak)} when it failed)" if peak else ""
        return (f"Out of memory with a micro-batch of 1 example{length}: one example's step needs more than "
                f"{have}{needed}. Fix: a larger `memory.budget` (or a larger GPU), "
                "`memory.checkpointing: full`, a shorter `data.max_length`, LoRA or quantization.\n"
                f"The error was: {message}")

    def _detect_mean_loss(self, model: nn.Module, piece: dict[str, Any], num_items_in_batch: Any) -> bool:
        """Whether the loss is a mean over its own micro-batch (True) or normalized by the step's items."""
        if num_items_in_batch is None:
            return True
        trainer = self.trainer
        was_training = model.training
        model.eval()  # no dropout: the two losses differ only by their normalization
        try:
            with torch.no_grad():
                prepared = trainer._prepare_inputs(piece)
                one = trainer.compute_loss(model, dict(prepared), num_items_in_batch=num_items_in_batch)
                two = trainer.compute_loss(model, dict(prepared), num_items_in_batch=2 * num_items_in_batch)
        finally:
            model.train(was_training)
        one, two = float(one.detach().float().mean()), float(two.detach().float().mean())
        if math.isclose(one, two, rel_tol=1e-4, abs_tol=1e-12):
            return True
        if math.isclose(one, 2 * two, rel_tol=1e-4, abs_tol=1e-12):
            return False
        raise MemtrainError(
            "Out-of-memory recovery cannot split this micro-batch exactly: the loss is neither a mean over "
            f"the micro-batch nor normalized by `num_items_in_batch` ({one:.6g} vs {two:.6g} with twice the "
            "items). Fix: a smaller `per_device_train_batch_size`, or a loss of one of those two kinds.")


# --------------------------------------------------------------------------------- helpers

# What allocators say when they run out: CUDA's caching allocator (torch.OutOfMemoryError), torch's
# CPU allocator (a plain RuntimeError: "DefaultCPUAllocator: can't allocate memory: you tried to
# allocate ..." or "... not enough memory ..."), and CUDA errors outside the caching allocator.
OOM_TEXTS = ("can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (on any device) rather than a bug in the step."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in OOM_TEXTS)



def split_batch(inputs: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split a collated batch into ``parts`` pieces along the first dimension (rows).

    Tensors whose first dimension is the batch are split (pieces differ by at most one row);
    everything else is shared by all pieces.
    """
    rows = batch_rows(inputs)
    count = min(parts, rows)
    pieces: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            for piece, chunk in zip(pieces, torch.tensor_split(value, count), strict=True):
                piece[key] = chunk
        else:
            for piece in pieces:
                piece[key] = value
    return pieces


def batch_rows(inputs: dict[str, Any]) -> int:
    """Examples in a collated batch (the first dimension of ``input_ids``, else of the first tensor)."""
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return int(ids.shape[0])
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise MemtrainError("Out-of-memory recovery: the batch holds no tensor to split. Fix: a data collator "
                        "that returns tensors.")


def count_items(trainer: Any, inputs: dict[str, Any]) -> int:
    """What a mean loss averages over, counted as the Trainer counts ``num_items_in_batch``.

    Labels other than -100 (from position 1 on for causal-LM losses, which shift labels); rows
    when the batch has no labels.
    """
    labels = inputs.get("shift_labels", inputs.get("labels"))
    if not isinstance(labels, torch.Tensor):
        return batch_rows(inputs)
    if "shift_labels" not in inputs and getattr(trainer, "_loss_shifts_labels", False):
        labels = labels[..., 1:]
    return int(labels.ne(-100).sum())


def free_memory() -> None:
    """Collect garbage and return cached device blocks (after the failed attempt's tensors are gone)."""
    gc.collect()
    if cuda_available():
        torch.cuda.empty_cache()


def reset_module_tracking() -> None:
    """Forget the modules a failed forward or backward left "running" in active memory trackers.

    torch's ``ModTracker`` (under memtrain's meter and simulated budget) pops a module when its
    forward or backward ends; one interrupted by an exception stays on its stack, and the next
    step's phases (forward / backward / optimizer) and recompute regions would be misread.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        modules = getattr(mode, "_mod_tracker", None)
        if modules is None:
            continue
        modules.parents = {"Global"}
        modules._active_module_cnt.clear()
        modules._post_bw_callbacks_to_enqueue.clear()
        modules._has_callback = False
        if hasattr(mode, "_ac_mod"):
            mode._ac_mod, mode._in_ac = None, False


def device_peak_bytes(inputs: dict[str, Any]) -> int | None:
    """The CUDA allocator's peak on the batch's device since the last reset, else None."""
    device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), None)
    if device is None or device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


