"""TRL: the private parts of ``DPOTrainer`` memtrain relies on.

Public first: memtrain configures TRL through ``DPOConfig`` (beta, loss type, reference
precomputation, ...) and runs the stock ``DPOTrainer``. What is here has no public API in TRL 1.16:

- :class:`DPOTrainerHooks`: ``_prepare_dataset`` forwarded to :meth:`~DPOTrainerHooks.prepare_dataset`
  (``DPOConfig`` has no flag to skip TRL's tokenization of a dataset memtrain already tokenized;
  SFTConfig's ``dataset_kwargs={"skip_prepare_dataset": True}`` has no DPO counterpart);
- :func:`dpo_loss`: ``DPOTrainer._compute_loss`` on an object built with ``DPOTrainer.__new__``
  holding only the attributes that method reads, for the estimator's traced step (building a real
  ``DPOTrainer`` needs a dataset, an accelerator and a process group);
- :func:`add_fused_head`: ``trl.trainer.utils.add_fused_lm_head`` (not exported by ``trl``);
- :func:`forget_metrics`: ``_metrics`` and ``_total_train_tokens``, what TRL's trainers collect in
  ``compute_loss`` (the auto-fit probe's steps are not training steps);
- :func:`generated`: ``GRPOTrainer``'s training step without its generation: its ``_prepare_inputs``
  (which generates completions every ``steps_per_generation`` steps) answers the given, already
  generated inputs, and its step counter ``_step`` is put back (the estimator traces the loss step);
- :class:`GenerationSteps`: a ``GRPOTrainer``'s training step in two halves, generation (or the
  buffered slice of the last generation) and the loss step on it, so that out-of-memory recovery
  can redo the loss step on the same completions;
- :func:`mark_generation`: which call generates a ``GRPOTrainer``'s completions. TRL 1.16 has no
  callback event for it; it calls ``generate`` (``generate_batch`` with transformers' paged
  generation) on ``accelerator.unwrap_model`` of its model, which is ``trainer.model`` itself on one
  process, so wrapping those methods on that instance marks the phase.

Checked on trl 1.16.0 (installed; the tested range is :data:`memtrain._compat.versions.TESTED`, 1.16).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from memtrain._compat.versions import compat_error, private, require

_SHIM = "trl"


@functools.cache
def _check_prepare(cls: type) -> None:
    require(cls, ("_prepare_dataset",), f"{_SHIM}.DPOTrainerHooks", "trl")


class DPOTrainerHooks:
    """A mixin before ``trl.DPOTrainer`` in the bases: ``_prepare_dataset`` forwarded to
    :meth:`prepare_dataset` (TRL's behaviour by default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from trl import DPOTrainer

        _check_prepare(DPOTrainer)
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        return self.prepare_dataset(dataset, processing_class, args, dataset_name)

    def prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        """TRL's tokenization of a preference dataset (``DPOTrainer._prepare_dataset``)."""
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)  # type: ignore[misc]


def add_fused_head(model: nn.Module, outputs: tuple[str, ...]) -> None:
    """TRL's fused log-probability head on ``model`` (``trl.trainer.utils.add_fused_lm_head``, as
    ``DPOTrainer.__init__`` adds it), answering ``outputs``."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        raise compat_error(f"{_SHIM}.add_fused_head", "trl", "trl.trainer.utils.add_fused_lm_head") from None
    add_fused_lm_head(model, outputs=outputs)


class _Accelerator:
    """What ``DPOTrainer._compute_loss`` asks of accelerate in one process."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def unwrap_model(model: nn.Module) -> nn.Module:
        return model

    @staticmethod
    def gather_for_metrics(value: Any) -> Any:
        return value

    gather = gather_for_metrics


def dpo_loss(model: nn.Module, beta: float, loss_types: list[str],
             precompute_ref_logps: bool) -> Callable[[nn.Module, Any], torch.Tensor]:
    """``loss(model, batch)``: ``DPOTrainer._compute_loss`` itself, bound to an object holding the
    attributes that method reads, set as ``DPOTrainer.__init__`` sets them from a ``DPOConfig``
    with these values (and TRL's defaults for the rest). TRL 1.16's method reads further
    attributes only on branches a one-process trace without a reference model does not take
    (issue 35): a TRL that reads more fails here, in the estimator, not in training."""
    from trl import DPOTrainer

    compute = private(DPOTrainer, "_compute_loss", f"{_SHIM}.dpo_loss", "trl")
    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer.model, trainer.ref_model = model, None
    trainer.args = SimpleNamespace(gradient_checkpointing_kwargs=None)
    trainer.accelerator = _Accelerator(next(model.parameters()).device)
    trainer.beta, trainer.loss_types = beta, loss_types
    trainer.loss_weights = [1.0] * len(trainer.loss_types)
    trainer.precompute_ref_logps = precompute_ref_logps
    trainer.ld_alpha, trainer.f_divergence_type, trainer.label_smoothing = None, "reverse_kl", 0.0
    trainer.use_weighting, trainer.aux_loss_enabled, trainer._tp_size = False, False, 1
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens = 0

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return compute(trainer, model, batch, return_outputs=False)

    return loss


@contextlib.contextmanager
def generated(trainer: Any) -> Iterator[None]:
    """Inside: ``trainer.training_step(model, inputs, None)`` of a ``GRPOTrainer`` takes ``inputs`` as
    the generation outputs (TRL's ``_prepare_inputs`` answers them unchanged, no generation), and
    ``_step`` (TRL's micro-step counter) is what it was before. Nothing for another trainer."""
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        yield
        return
    private(GRPOTrainer, "_prepare_inputs", f"{_SHIM}.generated", "trl")
    step = private(trainer, "_step", f"{_SHIM}.generated", "trl")
    trainer.__dict__["_prepare_inputs"] = lambda inputs: inputs
    try:
        yield
    finally:
        trainer.__dict__.pop("_prepare_inputs", None)
        trainer._step = step


class GenerationSteps:
    """TRL's ``GRPOTrainer.training_step`` in two halves, for out-of-memory recovery.

    TRL's step prepares its inputs first: every ``steps_per_generation`` micro-steps it generates
    completions for a whole generation batch and scores them, and each micro-step takes its slice
    of that buffer by its counter ``_step``, which the step advances at its end. Redoing a step
    through ``training_step`` would generate again (new completions) or take another slice.
    Here :meth:`prepare` runs TRL's ``_prepare_inputs`` once per micro-batch; :meth:`step` runs the
    training step on those prepared inputs (:func:`generated`), as often as recovery needs, and
    :meth:`advance` moves ``_step`` on once the micro-batch is done, as TRL's step would have.
    """

    def __init__(self, trainer: Any) -> None:
        from trl import GRPOTrainer

        private(GRPOTrainer, "_prepare_inputs", f"{_SHIM}.GenerationSteps", "trl")
        private(trainer, "_step", f"{_SHIM}.GenerationSteps", "trl")
        self.trainer = trainer

    def prepare(self, inputs: Any) -> dict[str, Any]:
        """The micro-batch TRL trains on: generated (or taken from the buffer) as its step would."""
        return self.trainer._prepare_inputs(inputs)

    def step(self, step_fn: Callable[..., torch.Tensor], model: nn.Module, prepared: dict[str, Any],
             num_items_in_batch: Any) -> torch.Tensor:
        """``step_fn`` (the trainer's training step) on inputs :meth:`prepare` made."""
        with generated(self.trainer):
            return step_fn(model, prepared, num_items_in_batch)

    def advance(self) -> None:
        """The micro-batch is done: on to the next slice, as TRL's ``training_step`` ends."""
        self.trainer._step += 1


def is_trl(trainer: Any, name: str) -> bool:
    """Whether ``trainer`` is (a subclass of) TRL's trainer class ``name``, read from its class's
    MRO: no import of TRL, so False where TRL is not installed. The one test of a trainer's kind
    (the estimator, the plugin and the reliability layer all ask it here)."""
    return any(cls.__name__ == name and cls.__module__.split(".")[0] == "trl"
               for cls in type(trainer).__mro__)


def is_grpo(trainer: Any) -> bool:
    """Whether ``trainer`` is TRL's ``GRPOTrainer`` (or a subclass)."""
    return is_trl(trainer, "GRPOTrainer")


def generation_steps(trainer: Any) -> GenerationSteps | None:
    """:class:`GenerationSteps` of a ``GRPOTrainer``; None for any other trainer (or without TRL)."""
    return GenerationSteps(trainer) if is_grpo(trainer) else None


GENERATE_METHODS = ("generate", "generate_batch")  # HF generation; transformers' paged generation


def mark_generation(trainer: Any, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> bool:
    """Run every text generation of a ``GRPOTrainer`` inside ``context()`` (the meter's generation
    phase): the model's :data:`GENERATE_METHODS` are wrapped on ``trainer.model``'s instance, once.
    False (nothing wrapped) for another trainer, or where vLLM generates (not this process's tensors)."""
    if not is_grpo(trainer) or getattr(trainer.args, "use_vllm", False):
        return False
    model = trainer.model
    for name in GENERATE_METHODS:
        stock = getattr(model, name, None)
        if stock is None or getattr(stock, "memtrain_generation", False):
            continue

        def marked(*args: Any, _stock: Callable[..., Any] = stock, **kwargs: Any) -> Any:
            with context():
                return _stock(*args, **kwargs)

        marked.memtrain_generation = True  # type: ignore[attr-defined]
        setattr(model, name, marked)
    return True


def forget_metrics(trainer: Any) -> None:
    """Drop what TRL's trainers collected in ``compute_loss`` since the last log (``_metrics``,
    ``_total_train_tokens``); nothing for a trainer without them."""
    metrics = getattr(trainer, "_metrics", None)
    if isinstance(metrics, dict):
        for values in metrics.values():
            values.clear()
    if hasattr(trainer, "_total_train_tokens"):
        trainer._total_train_tokens = 0
