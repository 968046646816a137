"""Predict a Trainer's own step: its ``training_step`` (so its ``compute_loss``) traced on fake tensors.

memtrain's recipe estimate (:mod:`memtrain.estimator.estimate`) models the model's own loss on
``B`` rows. A Trainer subclass may do much more in ``compute_loss``: TRL's SFTTrainer computes
log-probabilities and entropy through a chunked LM head (fp32 tiles of up to 4,096 tokens × 32,768
vocabulary entries, whatever the model); TRL's DPOTrainer runs the policy on ``2B`` rows
(``[chosen; rejected]``) and a reference forward (a LoRA model with its adapter disabled, under
``no_grad``, or a separate ``ref_model``). Rather than a special case per trainer,
:func:`trainer_step_estimate` runs what the Trainer itself runs, on fake tensors:

1. a batch from the Trainer's own collator, over the longest examples of its (already tokenized)
   training set: the micro-batch of ``per_device_train_batch_size`` examples with the most tokens
   (TRL's ``GRPOTrainer``: the worst-case generation output of :func:`memtrain.estimator.grpo.step_batch`,
   which its ``compute_loss`` is handed; the generation itself is not traced, see
   :func:`memtrain.estimator.grpo.trainer_generation_phase`);
2. the Trainer's model (as the Trainer wrapped it: peft adapter, TRL's fused head, memtrain's
   patches) and its ``ref_model``, with every weight and buffer swapped for a fake one for the
   trace (no weight is copied; the real ones are put back);
3. the Trainer's own optimizer (``create_optimizer`` on the fake weights), with its state;
4. under the estimator's meter (:class:`memtrain.estimator.trace_events.TracingMeter`, the same
   counting as the plugin's measurement): the Trainer class's ``training_step`` on that batch
   (forward, ``compute_loss``, backward; with accumulation, on the gradients the earlier
   micro-batches leave; for ``bf16``/``fp16`` mixed precision, under the autocast ``train()``
   will wrap the model's forward in), gradient clipping, the optimizer step and ``zero_grad``, as
   the Trainer's loop runs them.

Nothing of the Trainer is changed: its weights, optimizer and the metrics its
``compute_loss`` records (:mod:`memtrain.reliability.replay`) are put back. Values read into
Python during the trace (``.item()`` for metrics) answer 1 (:func:`memtrain.estimator.fake.fake_tensor_mode`).

What cannot be traced (a collator or loss that needs values, e.g. ``.numpy()``, a kernel without
a fake implementation, e.g. Triton kernels on a GPU, a data set that is not tokenized yet) comes back as a
:class:`TrainerEstimate` with ``peak_bytes=None`` and the reason: the caller says "not
modelled", never "fits".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from memtrain._compat.accelerate import original_forward
from memtrain._compat.datasets import feature_type
from memtrain._compat.torch_tools import FakeTensorMode, module_tensor_tables, unset_fake_temporarily
from memtrain._compat.transformers_trainer import collator_with_removed_columns, remove_unused_columns
from memtrain._compat.trl import generated, is_grpo
from memtrain.data.rows import Rows
from memtrain.estimator.fake import fake_tensor_mode, quiet_libraries
from memtrain.estimator.grpo import step_batch
from memtrain.estimator.trace import HOST, ROUNDED, create_optimizer_state
from memtrain.estimator.trace_events import CATEGORY_NAMES, TracingMeter
from memtrain.reliability.replay import restore_effects, snapshot_effects
from memtrain.trainer.step import hold_gradients

log = logging.getLogger(__name__)

# Trainer attributes the trace replaces with fake stand-ins and puts back.
SWAPPED = ("model", "model_wrapped", "ref_model", "optimizer", "current_gradient_accumulation_steps")


@dataclass
class TrainerEstimate:
    """A Trainer's predicted step, or why it could not be predicted.

    Attributes:
        trainer: the Trainer's class name.
        micro_batch: examples per micro-batch traced (``per_device_train_batch_size``).
        accumulation: micro-batches per optimizer step.
        peak_bytes: the step's peak (live tensor bytes; on CUDA each allocation rounded to 512
            bytes, as the meter counts); None: not modelled.
        by_category: the bytes per category at the peak.
        batch: the traced batch: each tensor's name and shape.
        reason: why the step was not modelled (``peak_bytes`` None).
    """

    trainer: str
    micro_batch: int
    accumulation: int
    peak_bytes: int | None = None
    by_category: dict[str, int] = field(default_factory=dict)
    batch: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reason: str | None = None

    @property
    def modelled(self) -> bool:
        return self.peak_bytes is not None

    def describe(self) -> str:
        """One line: what was traced, or why not."""
        if not self.modelled:
            return f"{self.trainer}'s training step is not modelled: {self.reason}"
        shapes = ", ".join(f"{k} {tuple(v)}" for k, v in self.batch.items())
        return (f"{self.trainer}'s own training_step traced on fake tensors: micro-batch "
                f"{self.micro_batch} × accumulation {self.accumulation}, batch {shapes}")


def trainer_step_estimate(trainer: Any, micro_batch: int | None = None,
                          accumulation: int | None = None) -> TrainerEstimate:
    """Trace one optimizer step of ``trainer`` (any ``transformers.Trainer`` subclass) on fake tensors.

    Args:
        trainer: the Trainer, built (its model wrapped, its data set prepared), before ``train()``.
        micro_batch: examples per micro-batch (default: ``args.per_device_train_batch_size``).
        accumulation: micro-batches per step (default: ``args.gradient_accumulation_steps``).

    Returns:
        The estimate; ``peak_bytes`` is None (with ``reason``) where the step could not be traced.
    """
    args = trainer.args
    micro = micro_batch or args.per_device_train_batch_size
    steps = accumulation or args.gradient_accumulation_steps
    result = TrainerEstimate(type(trainer).__name__, micro, steps)
    try:
        batch = step_batch(trainer, micro) if is_grpo(trainer) else longest_batch(trainer, micro)
    except Exception as err:
        result.reason = f"no batch could be built from its training set and collator ({_first_line(err)})"
        return result
    result.batch = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    try:
        values = _trace(trainer, batch, steps)
    except Exception as err:
        log.debug("tracing %s failed", type(trainer).__name__, exc_info=True)
        result.reason = f"its training step could not be traced on fake tensors ({_first_line(err)})"
        return result
    device = _device_of(trainer.model)
    totals = values[:, ROUNDED] if device.type == "cuda" else values[:, :HOST].sum(axis=1)
    top = int(np.argmax(totals))
    result.peak_bytes = int(totals[top])
    result.by_category = {name: int(v) for name, v in zip(CATEGORY_NAMES, values[top, :HOST], strict=True)}
    return result


# ------------------------------------------------------------------------------------ the batch


def longest_batch(trainer: Any, micro_batch: int) -> dict[str, Any]:
    """The Trainer's collator over the ``micro_batch`` examples of its training set with the most tokens.

    Tokens are counted over every column of token ids (lists of integers: ``input_ids``,
    TRL's ``prompt_ids``/``chosen_ids``/``rejected_ids``, a packed row's ``seq_lengths`` aside);
    columns the Trainer drops before collating are dropped as its dataloader drops them. A stream
    (an iterable data set, whose longest examples cannot be known in advance) gives its first
    ``micro_batch`` examples.
    """
    return longest_batch_rows(trainer, micro_batch)[0]


def longest_batch_rows(trainer: Any, micro_batch: int) -> tuple[dict[str, Any], Rows]:
    """:func:`longest_batch`, and what it says about the data as the planner's :class:`Rows`.

    ``Rows.longest`` is the collated batch's row length (the collator's padding included), or, for
    a collator that flattens the batch into one row of sequences (``DataCollatorWithFlattening``,
    TRL's padding-free), the longest sequence; ``packed`` when position ids restart inside a row;
    ``uniform`` when every example has the same number of tokens (a stream: unknown, so False).
    """
    import datasets

    if is_grpo(trainer):  # prompts, not token ids: the batch is the generation's worst-case output
        batch = step_batch(trainer, micro_batch)
        longest = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
        return batch, Rows(longest=longest, uniform=False, packed=False, read=True)
    dataset = trainer.train_dataset
    collator = trainer.data_collator
    if isinstance(dataset, datasets.Dataset):
        dataset = remove_unused_columns(trainer, dataset, description="training")
    else:
        collator = collator_with_removed_columns(trainer, collator, description="training")
    sizes = None
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        examples = list(itertools.islice(iter(dataset), micro_batch))  # a stream: its first examples
    else:
        sizes = _token_counts(dataset)
        examples = [dataset[int(i)] for i in np.argsort(-sizes, kind="stable")[:micro_batch]]
    batch = dict(collator(examples))
    ids = next((v for k, v in batch.items() if k.endswith("input_ids") and isinstance(v, torch.Tensor)),
               None)
    if ids is None:
        raise ValueError(f"its collator makes no input_ids (it makes {sorted(batch)})")
    packed = _packed(batch)
    longest = int(ids.shape[-1])
    if packed and ids.dim() == 2 and ids.shape[0] == 1 and len(examples) > 1:  # one row of sequences
        positions = batch["position_ids"][0]
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), int(positions.numel())]
        longest = max(b - a for a, b in itertools.pairwise(starts))
    uniform = sizes is not None and int(sizes.min()) == int(sizes.max())
    return batch, Rows(longest=longest, uniform=uniform, packed=packed, read=True)


def _token_counts(dataset: Any) -> np.ndarray:
    """Tokens per example: the lengths of its integer-list columns, summed."""
    import datasets

    if isinstance(dataset, datasets.Dataset):
        columns = [name for name, feature in dataset.features.items() if _is_token_list(feature)]
        if not columns:
            raise ValueError(f"no column of token ids among {dataset.column_names}: tokenize the data first")
        import pyarrow.compute as pc

        table = dataset.with_format("arrow")  # lengths from Arrow: no row is turned into Python lists
        return np.sum([pc.list_value_length(table[name]).to_numpy(zero_copy_only=False)
                       for name in columns], axis=0)
    counts = [sum(len(v) for v in dict(example).values() if _is_id_list(v)) for example in dataset]
    if not any(counts):
        raise ValueError("no list of token ids in its examples: tokenize the data first")
    return np.array(counts)


def _is_token_list(feature: Any) -> bool:
    import datasets

    inner = getattr(feature, "feature", None)
    if isinstance(feature, (datasets.Sequence, datasets.List)) and isinstance(inner, datasets.Value):
        return inner.dtype.startswith("int") and not feature_type(feature).startswith("Array")
    return False


def _is_id_list(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 1 and not value.is_floating_point()
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


# ------------------------------------------------------------------------------------ the trace


def _trace(trainer: Any, batch: dict[str, Any], accumulation: int) -> np.ndarray:
    """Per-op byte rows of one optimizer step of ``trainer`` on a fake copy of everything it holds."""
    mask = batch.get("attention_mask")
    # TRL's GRPO left-pads prompts of different lengths: its worst case holds the attention mask
    padded = (isinstance(mask, torch.Tensor) and not bool(mask.all())) or is_grpo(trainer)
    model = trainer.model
    held = [m for m in (model, getattr(trainer, "ref_model", None)) if isinstance(m, nn.Module)]
    with fake_tensor_mode(packed=_packed(batch), padded=padded, scalars=True) as mode, quiet_libraries(), \
            _swapped(trainer), _fake_weights(held, mode):
        tracker = trace_training_step(trainer, mode, batch, accumulation,
                                      cuda_kernels=_device_of(model).type == "cuda")
    return np.array(tracker.rows, dtype=np.int64)[:, 2:]


def trace_training_step(trainer: Any, mode: FakeTensorMode, batch: dict[str, Any], accumulation: int,
                        layers: list[nn.Module] | None = None, cuda_kernels: bool = False) -> Any:
    """One optimizer step of ``trainer``, whose weights are fake tensors of ``mode`` (inside it), under
    the estimator's meter; returns the meter's tracker (its rows, phases and, with ``layers``, the
    decoder layer of each op). The Trainer's ``create_optimizer`` and state, the earlier
    micro-batches' gradients held (``accumulation`` > 1), the Trainer class's ``training_step``
    (TRL's GRPOTrainer: without its generation, :func:`memtrain._compat.trl.generated`), gradient
    clipping, the optimizer step and ``zero_grad``. Shared by :func:`trainer_step_estimate` and the
    recipe estimate of a GRPO recipe (:mod:`memtrain.estimator.grpo_step`); ``cuda_kernels``: the
    step runs on CUDA (:func:`memtrain.estimator.trace.trace_step`)."""
    model = trainer.model
    with generated(trainer):
        trainer.model_wrapped = model
        trainer.optimizer = None
        optimizer = trainer.create_optimizer()
        create_optimizer_state(model, optimizer)
        inputs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if accumulation > 1:
            hold_gradients(model)  # the earlier micro-batches' gradients, as memtrain's own trace holds them
        trainer.current_gradient_accumulation_steps = accumulation
        buffered = buffered_slices(trainer, mode, inputs)  # held through the step, as TRL's buffer is
        meter = TracingMeter(model, optimizer, {**inputs, **buffered}, list(layers or []), [], cuda_kernels)
        with meter, _mixed_precision(trainer):
            type(trainer).training_step(trainer, model, inputs, None)  # TRL's GRPO: no default for it
            del inputs
            params = [p for p in model.parameters() if p.grad is not None]
            if trainer.args.max_grad_norm:  # as the Trainer's loop; the multi-tensor norm real tensors get
                torch.nn.utils.clip_grad_norm_(params, trainer.args.max_grad_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del buffered
    return meter.tracker


def buffered_slices(trainer: Any, mode: FakeTensorMode, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """TRL's GRPOTrainer keeps a whole generation batch (``generation_batch_size`` completions per
    process) in its buffer while it trains on one micro-batch of it (``batch``): the rest, as new
    fake tensors of ``mode`` shaped like ``batch``'s rows (empty for any other trainer)."""
    if not is_grpo(trainer):
        return {}
    args = trainer.args
    rows = int(batch["completion_ids"].shape[0])
    rest = max(0, args.generation_batch_size // max(1, args.world_size) - rows)
    slices = rest // max(1, rows)
    with mode:  # new storages (from_tensor would hand back the batch's own fakes)
        return {f"buffered: {k}": torch.empty((rest, *v.shape[1:]) if v.dim() else (slices,), dtype=v.dtype,
                                              device=v.device)
                for k, v in batch.items() if isinstance(v, torch.Tensor)}


@contextmanager
def _swapped(trainer: Any) -> Iterator[None]:
    """Put back the Trainer's model, reference model, optimizer and metrics after the trace."""
    saved = {name: trainer.__dict__[name] for name in SWAPPED if name in trainer.__dict__}
    effects = snapshot_effects(trainer)
    training = trainer.model.training
    try:
        yield
    finally:
        for name in SWAPPED:
            if name in saved:
                trainer.__dict__[name] = saved[name]
            else:
                trainer.__dict__.pop(name, None)
        restore_effects(trainer, effects)
        trainer.model.train(training)


@contextmanager
def _fake_weights(modules: list[nn.Module], mode: FakeTensorMode) -> Iterator[None]:
    """Every parameter and buffer of ``modules`` replaced by a fake one (same shape, dtype, device,
    ``requires_grad``; no storage) and put back on exit.

    In place, not on a copy: the modules' Python state stays what the Trainer built (peft's
    adapters, TRL's fused head, memtrain's patches and hooks are closures over these very modules,
    which a deep copy would leave pointing at the real ones). Tied weights stay tied (one fake per
    tensor); attributes a weight carries (a 4-bit weight's quantization state) go with it.
    """
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, Any]] = []

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            with unset_fake_temporarily():
                new = mode.from_tensor(tensor, static_shapes=True)
            if isinstance(tensor, nn.Parameter) and not isinstance(new, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            for key, value in tensor.__dict__.items():
                new.__dict__.setdefault(key, value)
            fakes[id(tensor)] = new
        return fakes[id(tensor)]

    try:
        for module in {id(m): m for root in modules for m in root.modules()}.values():
            for table in module_tensor_tables(module):
                for name, tensor in table.items():
                    if tensor is not None:
                        swapped.append((table, name, tensor))
                        table[name] = fake(tensor)
        yield
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor


def _mixed_precision(trainer: Any) -> Any:
    """The autocast ``train()`` will add: accelerate wraps the model's forward in it when the
    Trainer prepares the model (``bf16=True``/``fp16=True`` with weights of another dtype), which
    happens in ``train()``, after ``attach``. A model already prepared keeps its own."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not getattr(accelerator, "native_amp", False) or (
            original_forward(trainer.model) is not None):
        return contextlib.nullcontext()
    return accelerator.autocast()


def _packed(batch: Mapping[str, Any]) -> bool:
    """Whether the batch's rows hold several sequences (position ids restart, no attention mask)."""
    positions = batch.get("position_ids")
    if "attention_mask" in batch or not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return False
    return bool((positions[:, 1:] == 0).any())


def _device_of(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _first_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
