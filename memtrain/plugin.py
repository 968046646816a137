"""memtrain for people who keep their own ``transformers.Trainer`` script: two lines.

::

    model, args = prepare_for_budget(model, args, "24GiB")          # fit the step to the budget
    trainer = Trainer(model=model, args=args, ..., callbacks=[MemoryBudgetCallback("24GiB")])

:class:`MemoryBudgetCallback` measures every logged step (memtrain's meter: live tensor bytes by
category; on CUDA also the allocator's peaks) and puts it into the Trainer's own logs, beside the
predicted peak when one is given and the usable part of the budget, so TensorBoard, W&B or any
other tracker records them; it warns when a measured peak exceeds the usable budget. It also
installs memtrain's out-of-memory recovery (:mod:`memtrain.recovery`) into the Trainer: a
micro-batch that runs out of memory is split in two and its optimizer step redone.

:func:`prepare_for_budget` describes the user's model and arguments as a memtrain recipe, asks the
estimator (no weights are touched) for the least change that fits — the largest micro-batch that
keeps per-device batch × accumulation unchanged, then activation checkpointing, then an 8-bit
optimizer — applies memtrain's checkpointing patch to the model and returns adjusted arguments.

How the callback reaches the Trainer: callbacks are not handed their Trainer, so it is found on
the call stack the first time the Trainer calls the callback (``on_init_end``, from
``Trainer.__init__``), the same trick :mod:`memtrain.callbacks` uses to order itself before the
reporting integrations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from memtrain import hostmem
from memtrain.callbacks import MemoryMeterCallback, _move_before_integrations
from memtrain.config import RunConfig
from memtrain.errors import MemtrainError
from memtrain.eval_recovery import EvalBatchRecovery
from memtrain.memory.budget import SimulatedBudget, resolve_budget, usable_bytes
from memtrain.recovery import MicroBatchRecovery
from memtrain.units import format_bytes, parse_size

log = logging.getLogger(__name__)

MiB = 2**20
# TrainingArguments.optim -> memtrain's training.optimizer (the inverse of memtrain.trainer.OPTIMIZERS)
OPTIM_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_bnb_8bit": "adamw_8bit",
               "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
               "adafactor": "adafactor", "sgd": "sgd"}


def find_trainer(depth: int = 12) -> Trainer | None:
    """The Trainer that is calling the current callback, found on the call stack."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


class MemoryBudgetCallback(MemoryMeterCallback):
    """Measured vs predicted memory in the Trainer's logs, a warning over budget, OOM recovery.

    Args:
        budget: the memory the run may use, like ``"24GiB"``, a number of bytes, or ``"auto"``
            (the device's free memory); None logs measurements only.
        margin: fraction of the budget kept free; measured peaks above the rest are warned about.
        predicted: the predicted peak (bytes or a size, e.g. from ``memtrain estimate``), logged
            as ``memory/predicted_peak_mib`` beside the measured ``memory/peak_mib``.
        simulate: enforce the budget as a simulated one (CPU testing): torch's out-of-memory error
            as soon as live tensor bytes exceed it.
        simulate_budget: enforce this limit instead of ``budget`` (implies ``simulate``).
        recover: install out-of-memory recovery into the Trainer.
        every: measure the first two steps, then one in ``every``.
    """

    def __init__(self, budget: str | int | None = None, *, margin: float = 0.1,
                 predicted: str | int | None = None, simulate: bool = False,
                 simulate_budget: str | int | None = None, recover: bool = True, every: int = 1) -> None:
        self.predicted = parse_size(predicted) if predicted is not None else None
        super().__init__(every=every, keep_timeline=False, predicted_bytes=self.predicted)
        self.budget = budget if isinstance(budget, int) or budget is None else resolve_budget(budget)
        self.usable = usable_bytes(self.budget, margin) if self.budget is not None else None
        limit = simulate_budget if simulate_budget is not None else (self.budget if simulate else None)
        if limit is None and simulate:
            raise MemtrainError("MemoryBudgetCallback(simulate=True) needs `budget` or `simulate_budget`.")
        self.limit = parse_size(limit) if limit is not None else None
        self.recover = recover
        self.recovery: MicroBatchRecovery | None = None
        self.eval_recovery: EvalBatchRecovery | None = None
        self._tracked: tuple[Any, Any, Any] = (None, None, None)
        self.over_budget: list[int] = []  # global steps whose measured peak exceeded the usable budget
        self._simulated: SimulatedBudget | None = None

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        _move_before_integrations(self)
        trainer = find_trainer()
        if trainer is not None and trainer.loss_is_scaled_for_ga is None and _is_classifier(trainer.model):
            # Transformers 5 would skip 1/accumulation for sequence classifiers (their forward takes
            # **kwargs, but the loss is a plain mean): gradients would grow with the accumulation
            # that prepare_for_budget raises. Same fix as memtrain.trainer.build_trainer.
            trainer.loss_is_scaled_for_ga = False
        if self.recover and trainer is not None and getattr(trainer, "oom_recovery", None) is None:
            self.recovery = MicroBatchRecovery(trainer, budget_bytes=self.limit or self.budget).install()
            self.eval_recovery = EvalBatchRecovery(trainer).install()
        if self.limit is not None and trainer is not None:
            stock = trainer.evaluate

            def evaluate(*args: Any, **kwargs: Any) -> dict[str, float]:
                with self.paused():  # the budget limits training steps, as in `memtrain train`
                    return stock(*args, **kwargs)

            trainer.evaluate = evaluate

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        super().on_train_begin(args, state, control, **kwargs)
        if self.limit is not None:
            self._close_simulated()  # a loop restarted by auto_find_batch_size never ended
            inner = getattr(optimizer, "optimizer", optimizer)
            opt = inner if isinstance(inner, torch.optim.Optimizer) else None
            self._tracked = (model, opt, args.device)
            self._simulated = SimulatedBudget(self.limit, model, opt, device=args.device)
            self._simulated.__enter__()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No simulated budget inside (evaluation: it limits training steps; tracking every op
        would also slow evaluation several times over)."""
        if self._simulated is None:
            yield
            return
        self._close_simulated()
        try:
            yield
        finally:
            model, opt, device = self._tracked
            self._simulated = SimulatedBudget(self.limit or 0, model, opt, device=device)
            self._simulated.__enter__()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        measured = max(self._since_log, key=lambda r: r.peak_bytes) if self._since_log else None
        super().on_log(args, state, control, logs=logs, **kwargs)
        if logs is None or measured is None or "memory/peak_mib" not in logs:
            return
        extra: dict[str, float] = {}
        if self.predicted is not None:  # memory/predicted_peak_mib: logged by MemoryMeterCallback
            error = (self.predicted - measured.peak_bytes) / measured.peak_bytes
            extra["memory/predicted_error_pct"] = 100.0 * error
        if self.usable is not None:
            extra["memory/budget_usable_mib"] = self.usable / MiB
            if measured.peak_bytes > self.usable:
                self.over_budget.append(state.global_step)
                log.warning("Step %d: measured peak %s exceeds the usable budget %s (budget %s minus the "
                            "margin).", state.global_step, format_bytes(measured.peak_bytes),
                            format_bytes(self.usable), format_bytes(self.budget or 0))
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def close(self) -> None:
        """Stop measuring and leave the simulated budget (also after an exception)."""
        super().close()
        self._close_simulated()

    def _close_simulated(self) -> None:
        if self._simulated is not None:
            self._simulated.__exit__(None, None, None)
            self._simulated = None


# ---------------------------------------------------------------------------- prepare_for_budget


def _is_classifier(model: nn.Module) -> bool:
    inner = getattr(model, "get_base_model", lambda: model)()
    return type(inner).__name__.endswith("ForSequenceClassification")


def prepare_for_budget(model: nn.Module, args: TrainingArguments, budget: str | int, *,
                       allow_approximate: bool = False, max_length: int = 512, margin: float = 0.1
                       ) -> tuple[nn.Module, TrainingArguments]:
    """Patch ``model`` and adjust ``args`` so that a training step fits ``budget``.

    Args:
        model: the model the script trains (plain, or a peft LoRA model).
        args: its TrainingArguments; per-device batch × accumulation is kept exactly.
        budget: like ``"24GiB"``, bytes, or ``"auto"`` (the device's free memory).
        allow_approximate: let the planner also choose approximate-gradient layers (few-bit
            activation backward, randomized linear backward), which change the gradients.
        max_length: the longest example in tokens (the step is sized for it: the worst case).
        margin: fraction of the budget kept free for what estimates miss.

    Returns:
        The model (with activation checkpointing and the chunked loss when they were needed, and
        LoRA layers that keep their input in its own dtype) and new TrainingArguments
        (``per_device_train_batch_size``, ``gradient_accumulation_steps``, maybe ``optim``).
        Training on a CPU with glibc, the process also keeps freed memory for reuse
        (:func:`memtrain.hostmem.keep_freed_pages`: no page faults for tensors above 32 MiB).

    Raises:
        MemtrainError: nothing fits; the message has the smallest predicted peak.
    """
    from memtrain import planner

    total = resolve_budget(budget) if isinstance(budget, str) else budget
    base = recipe_for(model, args, max_length, allow_approximate)
    auto: dict[str, Any] = {"training.micro_batch_size": "auto", "training.gradient_accumulation": "auto",
                            "memory.checkpointing": "auto", "memory.margin": margin}
    if allow_approximate:
        auto.update({"memory.activation_bits": "auto", "memory.randomized_linear": "auto"})
    if base.model.task == "causal-lm":
        auto["memory.loss"] = "auto"
    optimizers = [base.training.optimizer]
    if "8bit" not in base.training.optimizer:
        optimizers.append("adamw_8bit")  # your optimizer first; the 8-bit one only if nothing else fits
    failure = None
    for optimizer in optimizers:
        try:
            decided = planner.plan(planner.with_values(base, {**auto, "training.optimizer": optimizer}),
                                   int(total))  # type: ignore[arg-type]
        except planner.NothingFits as err:
            failure = err
            continue
        return _apply_plan(model, args, decided, optimizer != base.training.optimizer)
    raise MemtrainError(f"prepare_for_budget: {failure}")


def _apply_plan(model: nn.Module, args: TrainingArguments, decided: Any, new_optimizer: bool
                ) -> tuple[nn.Module, TrainingArguments]:
    """Patch ``model`` as the plan says and return the matching TrainingArguments."""
    from memtrain.config import FewBitConfig, RandomizedLinearConfig
    from memtrain.patches import checkpointing, chunked_loss, fewbit, lora, randomized_linear
    from memtrain.trainer import OPTIMIZERS

    settings = decided.settings()
    lora.lean_lora_layers(model)  # as memtrain's estimate of a LoRA model assumes (exact)
    if settings.get("memory.loss") == "chunked":
        chunked_loss.apply(model)
    mode = settings["memory.checkpointing"]
    if mode != "none":
        checkpointing.apply(model, mode)
    if settings.get("memory.activation_bits"):
        fewbit.apply(model, FewBitConfig(bits=settings["memory.activation_bits"]))
    if settings.get("memory.randomized_linear"):
        randomized_linear.apply(model, RandomizedLinearConfig(**settings["memory.randomized_linear"]))
    updates: dict[str, Any] = {"per_device_train_batch_size": settings["training.micro_batch_size"],
                               "gradient_accumulation_steps": settings["training.gradient_accumulation"]}
    if new_optimizer:
        updates["optim"] = OPTIMIZERS["adamw_8bit"][0]
    if decided.device == "cpu" and hostmem.keep_freed_pages():
        log.info("prepare_for_budget: freed host memory is kept for reuse (memtrain.hostmem)")
    log.info("prepare_for_budget: %s; predicted peak %s of %s usable", decided.chosen.label(),
             format_bytes(decided.chosen.peak), format_bytes(decided.usable))
    return model, dataclasses.replace(args, **updates)


def recipe_for(model: nn.Module, args: TrainingArguments, max_length: int,
               allow_approximate: bool = False) -> RunConfig:
    """A memtrain recipe that describes a user's model and TrainingArguments (for the estimator)."""
    from memtrain.config import load_recipe

    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base_model.config
    name = type(base_model).__name__
    task = "sequence-classification" if "SequenceClassification" in name else "causal-lm"
    if task == "causal-lm" and "CausalLM" not in name:
        raise MemtrainError(f"prepare_for_budget: {name} is neither a causal LM nor a sequence classifier; "
                            "memtrain estimates those two tasks.")
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(next(model.parameters()).dtype, "fp32")
    if args.optim not in OPTIM_NAMES:
        raise MemtrainError(f"prepare_for_budget: `optim={args.optim}` is not one memtrain estimates. Fix: "
                            f"one of {', '.join(sorted(OPTIM_NAMES))}.")
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in (
        "architectures", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id")}
    per_device = args.per_device_train_batch_size * args.gradient_accumulation_steps
    recipe = {
        "model": {"from_config": values, "tokenizer": "unused", "task": task, "dtype": dtype,
                  **({"num_labels": config.num_labels} if task != "causal-lm" else {})},
        "data": {"source": "unused", "max_length": max_length},
        "adapter": _adapter(model),
        "training": {"effective_batch_size": per_device, "micro_batch_size": "auto",
                     "gradient_accumulation": None, "optimizer": OPTIM_NAMES[args.optim],
                     "learning_rate": args.learning_rate, "max_grad_norm": args.max_grad_norm or None},
        "memory": {"allow_approximate": allow_approximate},
        "output": {"dir": args.output_dir or "unused"},
    }
    return load_recipe(recipe)


def _adapter(model: nn.Module) -> dict[str, Any]:
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return {"method": "full"}
    lora = next(iter(peft_config.values()))
    targets = lora.target_modules
    return {"method": "lora", "r": lora.r, "alpha": lora.lora_alpha, "dropout": lora.lora_dropout,
            "target_modules": "all-linear" if targets == "all-linear" else sorted(targets)}
