"""One optimizer step, the way the Trainer runs it: the only step loop outside the Trainer itself.

Estimation (fake tensors), measurement (benchmarks, ``measure_step``), tuning
(``time_recipe_step``), the auto-fit probe and the per-process FSDP trace all run this function,
so what they predict or measure is one step of the same code:

    for each micro-batch: loss = model(**batch).loss / accumulation; loss.backward()
                          # all but the last without gradient sync (accelerate's no_sync)
    clip_grad_norm_(max_grad_norm)      # when set
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

:func:`measure_step` runs it under the memory meter (:mod:`memtrain.memory.meter`), which is all
it imports from memtrain.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from memtrain._compat.torch_tools import FakeTensor
from memtrain.memory.meter import MemoryMeter, StepMemory

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def training_step(model: nn.Module, batches: Batch | Sequence[Batch], optimizer: torch.optim.Optimizer,
                  accumulation: int | None = None, max_grad_norm: float | None = None, *,
                  held_gradients: bool = False, skip_non_finite: bool = False,
                  loss_fn: LossFn | None = None) -> None:
    """One optimizer step: forward + backward per micro-batch, clipping, the update, zero_grad.

    Args:
        model: the (patched, possibly sharded) model; its ``forward`` returns ``.loss``.
        batches: the micro-batches of the step, or one batch used for every micro-batch.
        optimizer: the optimizer; ``zero_grad(set_to_none=True)`` ends the step, as in the Trainer.
        accumulation: micro-batches in the whole step, for the ``1/accumulation`` loss scale
            (default: ``len(batches)``, or 1 for a single batch).
        max_grad_norm: clip the total gradient norm to this (None or 0: no clipping).
        held_gradients: run only one micro-batch of a single batch: the earlier ones are stood in
            for by gradients the caller already put in place (:func:`hold_gradients`). From the
            second micro-batch on every micro-batch holds the same memory, so the step's peak is
            the same and its forward and backward cost one micro-batch. Not for FSDP2 models,
            whose earlier micro-batches leave full gradients that a caller cannot put in place:
            run two micro-batches instead.
        skip_non_finite: zero the gradients if any is not finite before the update (a probe at
            learning rate 0 must leave the weights unchanged: 0 x NaN is NaN).
        loss_fn: ``loss_fn(model, batch)`` is a micro-batch's loss where the Trainer's
            ``compute_loss`` is not the model's own (``training.objective: dpo``:
            :func:`memtrain.trainer.build.step_loss`); None: ``model(**batch).loss``.
    """
    single = isinstance(batches, Mapping)
    steps = accumulation or (1 if single else len(batches))
    runs = ([batches] * (1 if held_gradients else steps)) if single else list(batches)
    model.train()
    count = _token_count(runs[0])
    for i, batch in enumerate(runs):
        with _gradient_sync(model, i == len(runs) - 1):
            loss = model(**batch).loss if loss_fn is None else loss_fn(model, batch)
            # accelerate's backward divides a copy of the loss by the accumulation steps (even
            # at 1) and the Trainer keeps the undivided loss beside it through backward.
            scaled = loss / steps
            scaled.backward()
            del loss, scaled
    del count
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm:
        # torch picks the multi-tensor norm for real tensors on CPU and CUDA, but never for fake
        # ones (their type is not on its list): pick it explicitly so a trace does what a run does.
        foreach = True if any(isinstance(p, FakeTensor) for p in params[:1]) else None
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=foreach)
    if skip_non_finite and not all(bool(torch.isfinite(p.grad).all()) for p in params):
        for param in params:
            param.grad.zero_()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _token_count(batch: Batch) -> torch.Tensor | None:
    """What the Trainer's step holds as ``num_items_in_batch``: the trained-token count, a 0-dim
    float32 made before the first micro-batch and kept to the end of the step (None without labels,
    as the Trainer: a DPO batch has none). Its value does not matter to memory; the model's own
    loss is used as it is."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if labels is None:
        return None
    return torch.zeros((), dtype=torch.float32, device=labels.device)


def hold_gradients(model: nn.Module) -> None:
    """Give every trainable parameter without one a zero gradient: what a micro-batch leaves behind.

    Gradients have the parameter's shape, dtype and placement whatever their values, so the next
    micro-batch accumulates into them exactly as it would after a real one. (Not for FSDP2: its
    micro-batches without gradient sync leave full gradients inside FSDP, not in ``.grad``.)
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """The Trainer's accumulation (accelerate's ``no_sync``): micro-batches before the last reduce
    no gradients across processes. FSDP2 then keeps each parameter's full gradient until the last
    micro-batch reduce-scatters it; DDP leaves it in ``.grad`` (its buckets are not used)."""
    if sync:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def measure_step(model: nn.Module, batch: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer | None = None, timeline: bool = False) -> StepMemory:
    """Run and measure one step (:func:`training_step`): forward, backward, and the
    optimizer step with ``zero_grad(set_to_none=True)`` if an optimizer is given.

    Without an optimizer the gradients stay in place, as after a micro-batch of accumulation.
    """
    model.train()
    with MemoryMeter(model, optimizer, inputs=batch, timeline=timeline) as meter:
        if optimizer is not None:
            training_step(model, batch, optimizer)
        else:
            loss = model(**batch).loss
            loss.backward()
            del loss
    return meter.result()
