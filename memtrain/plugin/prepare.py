"""memtrain for people who keep their own ``transformers.Trainer`` script: two lines.

::

    model, args = prepare_for_budget(model, args, "24GiB")          # fit the step to the budget
    trainer = Trainer(model=model, args=args, ...)
    attach(trainer)                                                 # memory logs, OOM recovery

:class:`MemoryBudgetCallback` measures every logged step (memtrain's meter: live tensor bytes by
category; on CUDA also the allocator's peaks) and puts it into the Trainer's own logs, beside the
predicted peak when one is given and the usable part of the budget, so TensorBoard, W&B or any
other tracker records them; it warns when a measured peak exceeds the usable budget. It also
installs memtrain's out-of-memory recovery (:mod:`memtrain.reliability.recovery`) into the Trainer: a
micro-batch that runs out of memory is split in two and its optimizer step redone.

At :func:`attach`, a Trainer whose class computes its own loss (TRL's trainers) has that step
traced on fake tensors (:mod:`memtrain.plugin.trainer_step`): its peak is the logged prediction,
a micro-batch over the budget is refitted, and a step that cannot be traced is said to be not
modelled.

:func:`prepare_for_budget` describes the user's model and arguments as a memtrain recipe, asks the
planner (no weights touched) for the fastest settings that fit — the micro-batch (per-device batch
× accumulation unchanged), every technique the registry lets the plugin choose (``patch_knobs``),
an 8-bit optimizer only if nothing else fits — applies the chosen patches to the model
(``apply_patches``, as training does) and returns adjusted arguments;
the decision (:class:`memtrain.plugin.describe.BudgetPlan`) is printed and kept as
``model.memtrain_plan``, which the callback takes as its budget and prediction.

How the callback reaches the Trainer: transformers never hands a callback its Trainer, and
recovery must wrap the Trainer's ``training_step`` and ``prediction_step``. So the Trainer is
given explicitly: :func:`attach` (or ``MemoryBudgetCallback(...).attach(trainer)``) adds the
callback ahead of the reporting integrations and installs recovery. Passed only in
``callbacks=[...]``, the callback measures, logs and enforces a simulated budget, and warns once
that recovery needs ``attach``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from memtrain import patches
from memtrain._compat.transformers_model import own_checkpointing_on
from memtrain._compat.transformers_trainer import set_loss_scaled_for_ga
from memtrain._compat.versions import check_versions
from memtrain.data.rows import Rows
from memtrain.device import configure_allocator
from memtrain.errors import MemtrainError
from memtrain.estimator.grpo import phase_peaks
from memtrain.estimator.trainer_loss import TrainerEstimate
from memtrain.estimator.vllm_colocate import ColocateShare
from memtrain.memory.meter import StepMemory
from memtrain.plugin.apply import IN_PLACE, apply_plan, planned_fields, say
from memtrain.plugin.checks import check_attach, check_callback, check_prepare
from memtrain.plugin.colocate import colocated_vllm
from memtrain.plugin.describe import (
    BudgetPlan,
    Change,
    budget_plan,
    nothing_fits,
    planned_length,
    recipe_for,
)
from memtrain.plugin.options import Seen, option_notes
from memtrain.plugin.trainer_step import check_trainer_step, complete_plan, overrides_step
from memtrain.reliability.budget import HeldBudget, resolve_budget, usable_bytes
from memtrain.reliability.eval_recovery import EvalBatchRecovery
from memtrain.reliability.recovery import Fixes, MicroBatchRecovery
from memtrain.trainer.callbacks import MemoryMeterCallback
from memtrain.units import format_bytes, parse_size

log = logging.getLogger(__name__)

MiB = 2**20

# What recovery's messages tell a plugin user to change: their own arguments, not recipe fields.
PLUGIN_FIXES = Fixes(
    one_example=("a larger `budget=` (prepare_for_budget, attach; or a larger GPU), "
                 "`gradient_checkpointing=True` in your TrainingArguments (prepare_for_budget turns it into "
                 "memtrain's full checkpointing), shorter examples (your trainer's `max_length`), or a LoRA "
                 "adapter (`peft_config=`)"),
    micro_batch=("a smaller `per_device_train_batch_size` with a larger `gradient_accumulation_steps` in "
                 "your TrainingArguments (same effective batch), or "
                 "`memtrain.prepare_for_budget(model, args, budget)`, which picks them"))


class MemoryBudgetCallback(MemoryMeterCallback):
    """Measured vs predicted memory in the Trainer's logs, a warning over budget, OOM recovery.

    Args:
        budget: the memory the run may use, like ``"24GiB"``, a number of bytes, or ``"auto"``
            (the device's free memory); None logs measurements only. Or the plan
            ``prepare_for_budget`` attached to the model (``model.memtrain_plan``): its budget,
            margin and predicted peak.
        margin: fraction of the budget kept free; measured peaks above the rest are warned about.
        predicted: the predicted peak (bytes, a size, e.g. from ``memtrain estimate``, or a plan), logged
            as ``memory/predicted_peak_mib`` beside the measured ``memory/peak_mib``.
        simulate: enforce the budget as a simulated one (CPU testing): torch's out-of-memory error
            as soon as live tensor bytes exceed it.
        simulate_budget: enforce this limit instead of ``budget`` (implies ``simulate``).
        recover: install out-of-memory recovery into the Trainer.
        every: measure the first two steps, then one in ``every`` (default: the Trainer's
            ``logging_steps``, so that each log entry reports the step it is logged at).
        estimate: at :meth:`attach`, trace the Trainer's own training step on fake tensors
            (:mod:`memtrain.plugin.trainer_step`): its peak replaces the plan's prediction, and a
            micro-batch over the usable budget is refitted. ``"auto"``: for a Trainer whose class
            overrides ``compute_loss`` or ``training_step`` (TRL's trainers), and never over a
            ``predicted`` you gave; True: always; False: never.
    """

    def __init__(self, budget: str | int | BudgetPlan | None = None, *, margin: float = 0.1,
                 predicted: str | int | BudgetPlan | None = None, simulate: bool = False,
                 simulate_budget: str | int | None = None, recover: bool = True,
                 every: int | None = None, estimate: bool | str = "auto") -> None:
        check_callback("MemoryBudgetCallback", budget, margin=margin, predicted=predicted, simulate=simulate,
                       simulate_budget=simulate_budget, recover=recover, every=every, estimate=estimate)
        plan = next((p for p in (budget, predicted) if isinstance(p, BudgetPlan)), None)
        self.estimate = estimate if predicted is None or isinstance(predicted, BudgetPlan) else bool(
            estimate is True)  # a prediction you give is kept unless you ask for the trace
        self.trainer_estimate: TrainerEstimate | None = None
        self._plan_predicts = plan is not None and (predicted is None or predicted is plan)
        if plan is not None:  # prepare_for_budget's decision: its budget, margin and predicted peak
            budget = plan.budget if budget is None or budget is plan else budget
            predicted = plan.predicted_peak if predicted is None or predicted is plan else predicted
        self.plan = plan
        self.predicted = parse_size(predicted) if predicted is not None else None  # type: ignore[arg-type]
        super().__init__(every=every, keep_timeline=False, predicted_bytes=self.predicted)
        self.budget = budget if isinstance(budget, int) or budget is None else resolve_budget(budget)
        self.usable = usable_bytes(self.budget, margin) if self.budget is not None else None
        if plan is not None and self.budget == plan.budget:
            self.usable = plan.usable
        limit = simulate_budget if simulate_budget is not None else (self.budget if simulate else None)
        if limit is None and simulate:
            raise MemtrainError("MemoryBudgetCallback(simulate=True) needs `budget` or `simulate_budget`.")
        self.limit = parse_size(limit) if limit is not None else None
        self.recover = recover
        self.recovery: MicroBatchRecovery | None = None
        self.eval_recovery: EvalBatchRecovery | None = None
        self.over_budget: list[int] = []  # global steps whose measured peak exceeded the usable budget
        self._held = HeldBudget(self.limit) if self.limit is not None else None
        self._warned = self._evaluate_paused = self._attached = False
        self._outside = 0

    def attach(self, trainer: Trainer) -> MemoryBudgetCallback:
        """Add the callback to ``trainer`` (ahead of its reporting integrations) and install
        out-of-memory recovery for training and evaluation into it. Call before ``train()``."""
        super().attach(trainer)
        self._attached = True
        if self.plan is not None and self.plan.request and not self.trainer_estimate:
            found = self.trainer_estimate = complete_plan(trainer, self.plan, self.estimate,
                                                          prepare_for_budget)
            if self.predicted is None or self._plan_predicts:
                self.predicted = self.predicted_bytes = self.plan.predicted_peak if (
                    found is None or found.modelled) else None
                self.predicted_phases = dict(self.plan.phase_peaks) if self.predicted is not None else {}
        elif self.trainer_estimate is None and (self.estimate is True or (
                self.estimate == "auto" and overrides_step(trainer))):
            self._estimate_step(trainer)
        if getattr(trainer, "loss_is_scaled_for_ga", None) is None and _is_classifier(trainer.model):
            # Transformers 5 skips 1/accumulation for classifiers (a **kwargs forward, a plain-mean
            # loss): gradients would grow with accumulation. Same fix and shim as build_trainer.
            set_loss_scaled_for_ga(trainer, False)
        if self.recover and getattr(trainer, "oom_recovery", None) is None and self.recovery is None:
            self.recovery = MicroBatchRecovery(trainer, budget_bytes=self.limit or self.budget,
                                               fixes=PLUGIN_FIXES).install()
            self.eval_recovery = EvalBatchRecovery(trainer).install()
        if self.limit is not None and not self._evaluate_paused:
            stock = trainer.evaluate

            def evaluate(*args: Any, **kwargs: Any) -> dict[str, float]:
                with self.paused():  # the budget limits training steps, as in `memtrain train`
                    return stock(*args, **kwargs)

            trainer.evaluate = evaluate
            self._evaluate_paused = True
        if getattr(trainer.train, "_memtrain_closes", None) is not self:
            stock_train = trainer.train

            def train(*args: Any, **kwargs: Any) -> Any:
                try:
                    return stock_train(*args, **kwargs)
                finally:  # an error (recovery gave up) must not leave the budget or meter running
                    self.close()

            train._memtrain_closes = self  # type: ignore[attr-defined]
            trainer.train = train
        return self

    def _estimate_step(self, trainer: Trainer) -> None:
        """The Trainer's own step traced: its peak is the prediction (none if not modelled)."""
        found = self.trainer_estimate = check_trainer_step(trainer, self.usable)
        self.predicted = self.predicted_bytes = found.peak_bytes
        if found.modelled and (phases := phase_peaks(trainer, found)):  # GRPO: the larger phase's peak
            self.predicted_phases = phases
            self.predicted = self.predicted_bytes = max(phases.values())

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        super().on_train_begin(args, state, control, **kwargs)
        if args.device.type == "cuda":  # the context and library workspaces, outside the allocator
            from memtrain.device import outside_allocator_bytes

            self._outside = outside_allocator_bytes(args.device)
        if (self.recover or self.limit is not None) and not self._attached and not self._warned:
            self._warned = True
            log.warning("MemoryBudgetCallback: out-of-memory recovery (and pausing a simulated budget "
                        "during evaluation) needs the Trainer, which callbacks are never given: call "
                        "`memtrain.attach(trainer)` (or `callback.attach(trainer)`) before "
                        "`trainer.train()`; without it an out-of-memory error stops training.")
        if self._held is not None:
            self._held.start(model, optimizer, args.device)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """No simulated budget inside (evaluation: it limits training steps; tracking every op
        would also slow evaluation several times over), held again after."""
        return self._held.paused() if self._held is not None else contextlib.nullcontext()

    def _device_peak(self, measured: StepMemory) -> int:
        """The peak that runs out: on CUDA (no simulated limit) the allocator's reserved memory plus
        what the context and libraries hold outside it, not the tensors; else the live tensor bytes,
        on a CPU with the offloaded ones (the host is the same RAM, and the plan counts them: an
        activation offload's prediction read 59% above a device-only measurement)."""
        if measured.cuda_max_reserved is not None and self.limit is None:
            return measured.cuda_max_reserved + self._outside
        return _tensors(measured)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Each measured step against the usable budget (every one, logged or not)."""
        before = len(self._since_log)
        super().on_step_end(args, state, control, **kwargs)
        if self.usable is None or len(self._since_log) == before:
            return  # no budget, or this step was not measured
        peak = self._device_peak(self._since_log[-1])
        if peak > self.usable:
            self.over_budget.append(state.global_step)
            log.warning("Step %d: measured peak %s exceeds the usable budget %s (budget %s minus the "
                        "margin).", state.global_step, format_bytes(peak),
                        format_bytes(self.usable), format_bytes(self.budget or 0))

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        measured = max(self._since_log, key=lambda r: r.peak_bytes) if self._since_log else None
        super().on_log(args, state, control, logs=logs, **kwargs)
        if logs is None or measured is None or "memory/peak_mib" not in logs:
            return
        extra: dict[str, float] = {}
        if self.predicted is not None:  # memory/predicted_peak_mib: logged by MemoryMeterCallback
            held = _tensors(measured)
            extra["memory/predicted_error_pct"] = 100.0 * (self.predicted - held) / held
        for phase, predicted in self.predicted_phases.items():  # GRPO: each phase against its own
            if seen := logs.get(f"memory/{phase}_peak_mib"):
                extra[f"memory/{phase}_error_pct"] = 100.0 * (predicted / MiB - seen) / seen
        if measured.cuda_max_reserved is not None and self.limit is None:
            extra["memory/device_peak_mib"] = self._device_peak(measured) / MiB
        if self.usable is not None:
            extra["memory/budget_usable_mib"] = self.usable / MiB
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def close(self) -> None:
        """Stop measuring and leave the simulated budget (also after an exception)."""
        super().close()
        if self._held is not None:
            self._held.close()


def attach(trainer: Trainer, budget: str | int | BudgetPlan | None = None, **options: Any
           ) -> MemoryBudgetCallback:
    """Add a :class:`MemoryBudgetCallback` to an existing Trainer: the second of the two lines.

    Args:
        trainer: the user's Trainer (any subclass), before ``train()``.
        budget: a size, bytes, ``"auto"`` or a plan; default: the plan ``prepare_for_budget``
            attached to the Trainer's model (``model.memtrain_plan``), else measurement only.
        options: the callback's other arguments (``margin``, ``simulate_budget``, ``recover``, ...).

    Returns:
        The attached callback (its ``recovery``, ``over_budget``, ``steps``, ... for inspection).

    Raises:
        MemtrainError: ``trainer`` is not a Trainer, an option the callback does not take, or one of
            the wrong type or out of range (:mod:`memtrain.plugin.checks`).
    """
    check_versions()
    check_attach(trainer, budget, options, MemoryBudgetCallback)
    if budget is None:
        model = trainer.model
        budget = getattr(patches.base_model(model), "memtrain_plan",
                         getattr(model, "memtrain_plan", None))
    return MemoryBudgetCallback(budget, **options).attach(trainer)


# ---------------------------------------------------------------------------- prepare_for_budget


def _tensors(measured: StepMemory) -> int:
    """A measured step's peak live tensor bytes, on a CPU with the offloaded ones (the same RAM)."""
    return measured.peak_bytes + (measured.host_peak_bytes if measured.device.startswith("cpu") else 0)


def _is_classifier(model: nn.Module) -> bool:
    inner = patches.base_model(model)
    return type(inner).__name__.endswith("ForSequenceClassification")


def prepare_for_budget(model: nn.Module, args: TrainingArguments, budget: str | int, *,
                       allow_approximate: bool = False, max_length: int | None = None, margin: float = 0.1,
                       quiet: bool = False, peft_config: Any = None, rows: Rows | None = None,
                       memory: dict[str, Any] | None = None) -> tuple[nn.Module, TrainingArguments]:
    """Patch ``model`` and adjust ``args`` so that a training step fits ``budget``.

    Args:
        model: the model the script trains (plain, or a peft LoRA model): any class transformers'
            auto classes build for causal LM or sequence classification.
        args: its TrainingArguments; per-device batch × accumulation is kept exactly, and
            ``gradient_checkpointing=True`` is kept as memtrain's full checkpointing.
        budget: like ``"24GiB"``, bytes, or ``"auto"`` (the device's free memory).
        allow_approximate: let the planner also choose approximate-gradient layers (few-bit
            activation backward, randomized linear backward), which change the gradients.
        max_length: the longest example in tokens (default: docs/plugin.md, "The length planned for").
        margin: fraction of the budget kept free for what estimates miss.
        quiet: do not print the table of what was decided (it is in ``model.memtrain_plan``).
        peft_config: the peft ``LoraConfig`` your trainer will wrap the model with (TRL's
            ``peft_config=``): planned as that adapter, not as full fine-tuning.
        rows: the longest batch of your data (:class:`memtrain.data.rows.Rows`: its longest row,
            whether rows differ in length, whether they are packed); default: rows of
            ``max_length`` tokens that differ in length (padded), packed when ``args.packing`` or
            ``args.padding_free`` (TRL) says so.
        memory: ``memory`` fields fixed instead of planned (of those the plugin chooses, docs/plugin.md),
            e.g. ``{"tiled_mlp": True, "offload.activations": True}``; the rest are planned.

    Returns:
        The model (with the patches the plan chose, and LoRA layers that keep their input in its
        own dtype; the decision, a
        :class:`~memtrain.plugin.describe.BudgetPlan`, in ``model.memtrain_plan``) and new
        TrainingArguments (``per_device_train_batch_size``, ``gradient_accumulation_steps``, maybe
        ``optim``; ``gradient_checkpointing`` off, memtrain's patch does it). Calling it again on
        the same model first removes what the last call applied.
        Training on a CPU with glibc, the process also keeps freed memory for reuse
        (:func:`memtrain.memory.hostmem.keep_freed_pages`: no page faults for tensors above 32 MiB).

    Raises:
        MemtrainError: nothing fits (the message has the smallest reachable peak and the settings
            that reach it), or the model or arguments are not ones memtrain estimates; an argument of
            the wrong type or out of range, before anything is traced (:mod:`memtrain.plugin.checks`).
    """
    check_versions()
    check_prepare(model, args, budget, allow_approximate=allow_approximate, max_length=max_length,
                  margin=margin, quiet=quiet, peft_config=peft_config, rows=rows, memory=memory)
    from memtrain.plan import planner

    configure_allocator()  # the settings the calibrated overheads were measured under
    total = resolve_budget(budget) if isinstance(budget, str) else int(budget)
    length, length_from, notes = planned_length(model, args, max_length, rows)
    share = colocated_vllm(model, args, int(total), length, built=IN_PLACE.get() is not None)  # type: ignore[arg-type]
    if share is not None:  # TRL's GRPO with vLLM colocated: training gets what vLLM's share leaves
        total, notes = _beside_vllm(share, int(total), length_from, notes)  # type: ignore[arg-type]
    notes += option_notes(Seen(args, model))
    packed = bool(getattr(args, "packing", False) or getattr(args, "padding_free", False))
    base = recipe_for(model, args, length, allow_approximate, peft_config=peft_config,
                      packing=packed or bool(rows and rows.packed))
    inner = patches.base_model(model)
    user_checkpointing = own_checkpointing_on(inner) or any(
        bool(getattr(args, name, False)) for name in ("activation_checkpointing", "gradient_checkpointing"))
    pending = peft_config is not None and not hasattr(model, "peft_config")
    tiers = [planned_fields(memory, user_checkpointing, margin, pending, every=False),
             planned_fields(memory, user_checkpointing, margin, pending)]
    if tiers[0] == tiers[1]:
        tiers.pop()
    optimizers = [base.training.optimizer]
    if "8bit" not in base.training.optimizer:
        optimizers.append("adamw_8bit")  # your optimizer first; the 8-bit one only if nothing else fits
    failures: list[tuple[str, Any]] = []
    request = {"allow_approximate": allow_approximate, "margin": margin, "peft_config": peft_config,
               "memory": memory}
    # checkpointing and the chunked loss first, then every technique the plugin may choose
    # (apply.FIRST_FIELDS), then the same with the 8-bit optimizer: the fewest changes that fit
    cache = planner.TraceCache()  # a setting two tiers both try is traced once
    for optimizer, auto in ((o, a) for o in optimizers for a in tiers):
        planned = planner.with_values(base, {**auto, "training.optimizer": optimizer})
        try:
            decided = planner.plan(planned, int(total), rows=rows, alternatives=False,  # type: ignore[arg-type]
                                   cache=cache)
        except planner.NothingFits as err:
            failures.append((optimizer, err))
            continue
        changed = optimizer != base.training.optimizer
        adapter = base.adapter.method + (f" r={base.adapter.r}" if base.adapter.method == "lora" else "")
        result = budget_plan(decided, args, changed, user_checkpointing, adapter, decided.apply(planned),
                             fixed=memory)
        if share is not None and IN_PLACE.get() is None:  # set before the Trainer builds vLLM
            result.vllm = share
            result.changes += vllm_changes(share, args)
        return apply_plan(model, args, decided, _finish(result, model, args, budget, length, length_from,
                                                        notes, base.data.packing, quiet, request), planned)
    replanned = IN_PLACE.get() is not None  # attach, planning for the Trainer's longest batch
    error = nothing_fits(failures, int(total), margin, args, user_checkpointing,  # type: ignore[arg-type]
                         lora=base.adapter.method == "lora",
                         by=f"attach (the Trainer's longest batch, rows of {length} tokens)" if replanned
                         else "prepare_for_budget")
    if share is not None:  # the budget was what vLLM's colocated share left: say so, and what frees it
        error = MemtrainError(
            f"{error} (This budget is what vLLM's colocated share leaves: it takes "
            f"{format_bytes(share.held)} while training steps run, vllm_gpu_memory_utilization="
            f"{share.utilization:.2f}. Or: vllm_enable_sleep_mode=True, fewer completions generated at "
            "once, a shorter max_completion_length, or vllm_mode='server'.)")
    if length_from != "assumed":
        raise error
    # nothing fits rows of the assumed length: attach plans for the Trainer's data (or says nothing fits)
    result = BudgetPlan(int(total), usable_bytes(int(total), margin), "not planned", 0, {
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps})
    notes.append(f"nothing fits rows of the assumed {length} tokens ({str(error).split('. Fix')[0]}): "
                 "model and arguments are unchanged until attach plans for the Trainer's data")
    _finish(result, model, args, budget, length, length_from, notes, base.data.packing, quiet, request)
    model.__dict__["memtrain_plan"] = result
    return model, args


def _beside_vllm(share: ColocateShare, budget: int, length_from: str, notes: list[str]
                 ) -> tuple[int, list[str]]:
    """The budget training is planned into beside vLLM's colocated ``share``, and the notes saying so."""
    rest = budget - share.held
    said = [f"{share.describe()}; training is planned into the rest of the budget, {format_bytes(rest)}"]
    if length_from == "assumed" and share.max_model_len == share.length:
        said.append(f"vLLM's share is sized for completions of {share.length} tokens with their prompts "
                    "(the assumed length): pass max_length= (longest prompt + max_completion_length) or set "
                    "vllm_max_model_length, since vLLM is built with the Trainer, before attach reads the "
                    "data")
    if not share.fits:  # attach: the Trainer's vLLM was built with another utilization
        said.append(f"the Trainer's vLLM (vllm_gpu_memory_utilization={share.utilization:.2f}) holds "
                    f"{share.concurrent} of the {share.sequences} completions generated at once at "
                    f"{share.length} tokens: the rest wait (slower generation, not more memory)")
    if rest <= 0:
        raise MemtrainError(
            f"prepare_for_budget: vLLM colocated takes {format_bytes(share.held)} of the "
            f"{format_bytes(budget)} budget (vllm_gpu_memory_utilization={share.utilization:.2f} of the "
            f"GPU's {format_bytes(share.total)}, CUDA graphs beside it), leaving nothing to train. Fix: "
            "vllm_enable_sleep_mode=True (vLLM releases its share while training steps run), fewer "
            "completions at once (generation_batch_size), a shorter max_completion_length, or "
            "vllm_mode='server' (vLLM on another GPU).")
    return rest, notes + said


def vllm_changes(share: ColocateShare, args: Any) -> list[Change]:
    """The ``GRPOConfig`` fields vLLM's share sets (before the Trainer builds vLLM)."""
    changes = [Change("vllm_gpu_memory_utilization", f"{args.vllm_gpu_memory_utilization:g}",
                      f"{share.utilization:.2f}",
                      f"vLLM's weights and the KV cache of {share.sequences} completions x {share.length} "
                      "tokens, with allowances (see the notes)")]
    if getattr(args, "vllm_max_model_length", None) is None:
        changes.append(Change("vllm_max_model_length", "None (the model's positions)", str(share.length),
                              "vLLM checks that one request of this length fits its KV cache"))
    return changes


def _finish(result: BudgetPlan, model: nn.Module, args: TrainingArguments, budget: Any, length: int,
            length_from: str, notes: list[str], packed: bool, quiet: bool, request: dict[str, Any]
            ) -> BudgetPlan:
    """The plan's length, notes and request (for attach); printed now or left pending for attach."""
    result.settings.update(max_length=length, packed=packed)
    own_loss = type(args).__module__.split(".")[0] == "trl"  # TRL's trainers compute their own loss
    result.notes[:0] = notes + ([f"{type(args).__name__}: TRL's trainer computes its own loss, which "
                                 "only its own step shows: memtrain.attach(trainer) traces it and picks "
                                 "the micro-batch from that trace"] if own_loss else [])
    result.length_from, result.quiet = length_from, quiet
    result.pending = length_from == "assumed" or own_loss
    result.request = {"model": model, "args": args, "budget": budget, "options": request, "yours": {
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps}}
    if result.pending:  # completed by attach, which prints it: no table now that would not run
        lines = ["memtrain prepare_for_budget: memtrain.attach(trainer) completes the plan and prints the "
                 "one that will run", *(f"note: {note}" for note in result.notes)]
        (log.info if quiet else say)("\n".join(lines))
    elif not quiet:
        result.print()
    return result
