"""What :func:`memtrain.plugin.prepare.prepare_for_budget` decides, and how it describes the user's setup.

:func:`recipe_for` turns a user's model and ``TrainingArguments`` into a memtrain recipe for the
estimator (which task: the classes transformers' auto classes map to causal LM or sequence
classification for the model's ``model_type``). :class:`BudgetPlan` is the decision as the user
sees it: the settings chosen, the predicted peak, and each change with its reason, printed as a
short table and attached to the model as ``model.memtrain_plan``. :func:`nothing_fits` words the
planner's failure in the plugin's own argument names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from transformers import TrainingArguments
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)

from memtrain import patches
from memtrain.config import MemoryConfig, RunConfig
from memtrain.config.suggest import did_you_mean
from memtrain.errors import MemtrainError
from memtrain.patches import Knob
from memtrain.plugin.options import planned_attention, planned_optimizer
from memtrain.units import format_bytes

if TYPE_CHECKING:
    from memtrain.estimator.vllm_colocate import ColocateShare

EIGHT_BIT_OPTIM = "adamw_bnb_8bit"  # what TrainingArguments calls memtrain's adamw_8bit
TASKS = (("sequence-classification", MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
         ("causal-lm", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


@dataclass
class Change:
    """One setting ``prepare_for_budget`` changed (or kept on purpose), with its reason."""

    setting: str
    yours: str
    now: str
    why: str


@dataclass
class BudgetPlan:
    """``prepare_for_budget``'s decision, as ``model.memtrain_plan`` (pass it to the callback).

    Attributes:
        budget: the budget in bytes; ``usable`` is what is left after the margin.
        predicted_peak: the peak of one training step with the chosen settings: the estimator's
            for rows of ``settings["max_length"]`` tokens, or, once ``attach`` traced the Trainer's
            own step, that trace's.
        settings: the chosen values, by ``TrainingArguments`` name where there is one
            (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``optim``) and
            memtrain's patch names otherwise (``checkpointing``, ``loss``, ...), and what the
            plan is for: ``adapter``, ``max_length`` (tokens of the longest row), ``packed``.
        changes: what differs from the model and arguments given, and why.
        notes: what the prediction assumes and what it does not model (``attach`` adds what it
            found tracing the Trainer's own step).
        length_from: where ``max_length`` came from: ``"max_length="``, ``"rows="``,
            ``"args.max_length"``, ``"the data"`` (``attach`` read the Trainer's longest batch) or
            ``"assumed"`` (nothing to read: ``attach`` re-plans from the Trainer's data).
        pending: the plan is completed by ``attach`` (the length was assumed, or the Trainer
            computes its own loss), which prints it then; ``prepare_for_budget`` printed one line.
        vllm: vLLM's colocated share of the GPU (:mod:`memtrain.plugin.colocate`), whose
            ``vllm_gpu_memory_utilization`` the new arguments carry; the budget above is then what it
            leaves training.
        phase_peaks: for TRL's GRPOTrainer, once ``attach`` traced its step: the predicted peak of
            each phase, ``{"generation": ..., "training": ...}`` (``predicted_peak`` is the larger),
            logged beside the measured ones.
    """

    budget: int
    usable: int
    device: str
    predicted_peak: int
    settings: dict[str, Any]
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    length_from: str = "max_length="
    pending: bool = False
    quiet: bool = False
    phase_peaks: dict[str, int] = field(default_factory=dict)
    vllm: ColocateShare | None = None  # TRL's GRPO with vLLM colocated: its share, set in the args
    request: dict[str, Any] = field(default_factory=dict, repr=False)  # prepare_for_budget's call, to re-plan

    def table(self) -> Table:
        """The decision as a rich table: one row per change, then the predicted peak."""
        table = Table()
        # the names whole (a narrow terminal cut `per_device_train_batch_size` to `per_device_tr…`):
        # the reasons wrap instead
        names = [c.setting for c in self.changes] or ["(nothing)"]
        table.add_column("setting", no_wrap=True, min_width=max(map(len, names)))
        table.add_column("yours", overflow="fold")
        table.add_column("now", overflow="fold")
        table.add_column("why", ratio=1)
        for change in self.changes:
            table.add_row(change.setting, change.yours, change.now, change.why)
        if not self.changes:
            table.add_row("(nothing)", "", "", "your settings fit as they are")
        return table

    def summary(self, by: str = "prepare_for_budget") -> str:
        """One line: who planned (``prepare_for_budget``, or ``attach`` completing its plan), the
        predicted peak against the budget, and the length it is for."""
        packed = ", packed" if self.settings.get("packed") else ""
        return (f"memtrain {by}: predicted peak {format_bytes(self.predicted_peak)} of "
                f"{format_bytes(self.usable)} usable (budget {format_bytes(self.budget)}, {self.device}; "
                f"rows of {self.settings.get('max_length')} tokens{packed}, from {self.length_from})")

    def print(self, console: Console | None = None, by: str = "prepare_for_budget") -> None:
        """Print :meth:`summary` and :meth:`table` (to stderr by default, beside the Trainer's output)."""
        console = console or Console(stderr=True)
        console.print(self.summary(by), highlight=False)
        console.print(self.table())
        for note in self.notes:
            console.print(f"note: {note}", highlight=False)

    def use_micro_batch(self, micro: int, accumulation: int, peak: int) -> None:
        """Train at ``micro`` x ``accumulation`` with ``peak`` predicted (``attach``'s trace decided):
        the settings and the changes say so."""
        yours = self.request.get("yours", {})
        self.settings.update(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
        self.predicted_peak = peak
        self.changes = [c for c in self.changes if c.setting not in (
            "per_device_train_batch_size", "gradient_accumulation_steps")]
        if yours and micro != yours["per_device_train_batch_size"]:
            self.changes[:0] = [
                Change("per_device_train_batch_size", str(yours["per_device_train_batch_size"]), str(micro),
                       "the largest micro-batch whose traced step fits; the accumulation makes up the "
                       "rest, so your effective batch is unchanged"),
                Change("gradient_accumulation_steps", str(yours["gradient_accumulation_steps"]),
                       str(accumulation), "keeps per-device batch × accumulation")]


def task_of(model: nn.Module) -> str:
    """``causal-lm`` or ``sequence-classification``, from transformers' auto-class mappings.

    The model's class (or a base class) must be what ``AutoModelForCausalLM`` or
    ``AutoModelForSequenceClassification`` builds for its config's ``model_type`` (GPT-2's
    ``GPT2LMHeadModel`` is a causal LM); a class those map for any model type is accepted too.
    """
    names = {cls.__name__ for cls in type(model).__mro__}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for task, mapping in TASKS:
        if names & _names(mapping.get(model_type)):
            return task
    for task, mapping in TASKS:
        if names & {n for v in mapping.values() for n in _names(v)}:
            return task
    known = {task: sorted(_names(mapping.get(model_type))) for task, mapping in TASKS}
    raise MemtrainError(
        f"prepare_for_budget: `model` is a {type(model).__name__} (model_type {model_type!r}), which "
        "transformers' auto classes map to neither causal LM nor sequence classification, the two tasks "
        f"memtrain estimates. Fix: pass the model AutoModelForCausalLM ({known['causal-lm'] or 'none'}) "
        f"or AutoModelForSequenceClassification ({known['sequence-classification'] or 'none'}) builds.")


def _names(value: Any) -> set[str]:
    if value is None:
        return set()
    return {value} if isinstance(value, str) else set(value)


def recipe_for(model: nn.Module, args: TrainingArguments, max_length: int,
               allow_approximate: bool = False, *, peft_config: Any = None, packing: bool = False
               ) -> RunConfig:
    """A memtrain recipe that describes a user's model and TrainingArguments (for the estimator).

    ``peft_config``: the adapter a trainer will wrap the model in (TRL's ``peft_config=``);
    ``packing``: rows hold several examples (TRL's ``packing``/``padding_free``).
    """
    from memtrain.config import load_recipe

    base_model = patches.base_model(model)
    config = base_model.config
    task = task_of(base_model)
    precision = _precision(base_model)
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in (
        "architectures", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id",
        "quantization_config")}
    per_device = args.per_device_train_batch_size * args.gradient_accumulation_steps
    classify = task == "sequence-classification"
    recipe = {
        "model": {"from_config": values, "tokenizer": "unused", "task": task, **precision,
                  **({"attn_implementation": attention} if (attention := planned_attention(model)) else {}),
                  **({"num_labels": config.num_labels} if classify else {})},
        "data": {"source": "unused", "max_length": max_length,
                 **({"format": "classification"} if classify else {}),
                 **({"packing": True} if packing else {})},
        "adapter": _adapter(model, peft_config),
        "training": {"effective_batch_size": per_device, "micro_batch_size": "auto",
                     "gradient_accumulation": None, "optimizer": planned_optimizer(args),
                     "learning_rate": args.learning_rate, "max_grad_norm": args.max_grad_norm or None},
        "memory": {"allow_approximate": allow_approximate},
        "output": {"dir": args.output_dir or "unused"},
    }
    try:
        return load_recipe(recipe)
    except MemtrainError as err:
        raise MemtrainError(f"prepare_for_budget cannot describe this model and these TrainingArguments "
                            f"to memtrain's estimator:\n{err}") from err


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _precision(model: nn.Module) -> dict[str, Any]:
    """The ``model`` recipe keys for how the weights are stored: ``dtype`` and the quantization.

    A bitsandbytes model (``config.quantization_config``) is described by its quantization and
    compute dtype: after ``prepare_model_for_kbit_training`` its few unquantized weights are fp32,
    which says nothing about the rest. Otherwise the dtype holding most of the parameters (the
    first parameter may be an fp32 embedding or norm kept apart on purpose).
    """
    quant = getattr(model.config, "quantization_config", None)
    quant = quant.to_dict() if hasattr(quant, "to_dict") else (quant or {})
    if quant.get("load_in_4bit") or quant.get("load_in_8bit"):
        compute = quant.get("bnb_4bit_compute_dtype") or "bfloat16"
        compute = DTYPE_NAMES.get(getattr(torch, str(compute).replace("torch.", ""), None), "bf16")
        if quant.get("load_in_8bit"):
            return {"dtype": compute, "quantization": "int8"}
        return {"dtype": compute, "quantization": quant.get("bnb_4bit_quant_type", "nf4"),
                "compute_dtype": compute, "double_quant": bool(quant.get("bnb_4bit_use_double_quant"))}
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    dtype = max(counts, key=counts.__getitem__) if counts else torch.float32
    return {"dtype": DTYPE_NAMES.get(dtype, "fp32")}


def _adapter(model: nn.Module, given: Any = None) -> dict[str, Any]:
    """The adapter section: ``given`` (TRL's ``peft_config=``, checked to be a LoraConfig by
    :mod:`memtrain.plugin.checks`), else the adapter the model carries, else full fine-tuning."""
    peft_config = getattr(model, "peft_config", None)
    if given is None and not peft_config:
        return {"method": "full"}
    lora = given if given is not None else next(iter(peft_config.values()))  # type: ignore[union-attr]
    if type(lora).__name__ != "LoraConfig":
        raise MemtrainError(f"prepare_for_budget: the model carries a {type(lora).__name__} adapter; "
                            "memtrain estimates LoRA adapters. Fix: wrap the model with a peft `LoraConfig`, "
                            "or pass the model without its adapter.")
    targets = lora.target_modules
    return {"method": "lora", "r": lora.r, "alpha": lora.lora_alpha, "dropout": lora.lora_dropout,
            "target_modules": "all-linear" if targets == "all-linear" else sorted(targets)}


def patch_knobs() -> list[Knob]:
    """The recipe fields of patches the plugin may choose (registered with ``plugin=True``), in the
    planner's order. The Trainer-level settings it chooses (batch, optimizer) are not among them:
    ``prepare_for_budget`` turns those into TrainingArguments."""
    return [k for t in patches.techniques() if t.hook is not None for k in t.knobs if k.plugin]


def patch_names() -> list[str]:
    """The registered patches the plugin applies (those with a knob it may choose), in stage order."""
    return [t.name for t in patches.techniques() if t.hook is not None and any(k.plugin for k in t.knobs)]


# memory fields prepare_for_budget decides from its own arguments (budget=, margin=, allow_approximate=),
# or that describe loading the model, which the user did
NOT_FIXED_BY_MEMORY = ("memory.budget", "memory.simulate_budget", "memory.margin", "memory.allow_approximate",
                       "memory.lean_kbit", "memory.offload.parameters")


def memory_fields(memory: dict[str, Any] | None) -> dict[str, Any]:
    """``prepare_for_budget``'s ``memory=`` as dotted recipe fields (``{"offload": {"activations":
    True}}`` and ``{"offload.activations": True}`` are both ``memory.offload.activations``).

    A field may be a technique the plugin chooses (:func:`patch_knobs`) or a parameter of one that
    no knob decides (``offload.min_tensor_bytes``, ``tiled_mlp_tiles``, ``host_budget``).

    Raises:
        MemtrainError: a field the plugin cannot apply (a registered knob without ``plugin=True``,
            e.g. ``offload.optimizer``; one of prepare_for_budget's own arguments), or no such field.
    """
    fields = _dotted(memory or {}, "memory")
    choosable = {k.path for k in patch_knobs()}
    for path in fields:
        exists = _field_exists(path)
        if exists and _settable(path):
            continue
        key = path.removeprefix("memory.")
        names = ", ".join(f"{p.removeprefix('memory.')!r}" for p in sorted(choosable))
        fix = (f"memory= takes {names}, or a parameter of one (docs/RECIPES.md, the memory section, says "
               "what each takes).")
        if not exists:
            why = "is not a field of the recipe's memory section"
            fix = did_you_mean(key, memory_names(), {}, "memory") + fix
        elif path in OWN_ARGUMENTS:
            why = f"is prepare_for_budget's own argument `{OWN_ARGUMENTS[path]}`, not a memory setting"
            fix = f"pass it as prepare_for_budget(..., {OWN_ARGUMENTS[path]}...) and drop it from memory=."
        else:
            why = "is not a setting the plugin applies to your model"
        raise MemtrainError(f"prepare_for_budget: `memory={{{key!r}: ...}}` {why}. Fix: {fix}")
    return fields


# memory fields that are prepare_for_budget's own arguments
OWN_ARGUMENTS = {"memory.budget": "budget=", "memory.margin": "margin=", "memory.allow_approximate":
                 "allow_approximate="}


def memory_names() -> list[str]:
    """Every key ``memory=`` takes, dotted below ``memory`` (``tiled_mlp``, ``offload.activations``,
    ``offload.min_tensor_bytes``, ...): the techniques the plugin chooses and their parameters."""
    return [p.removeprefix("memory.") for p in _leaf_fields(MemoryConfig, "memory") if _settable(p)]


def _settable(path: str) -> bool:
    """Whether ``memory=`` may set the memory field ``path``: a technique the plugin chooses, or a
    parameter that no registered knob decides and that is not one of prepare_for_budget's own."""
    knobs = {k.path for k in patches.knobs()}
    return path in {k.path for k in patch_knobs()} or (path not in knobs and path not in NOT_FIXED_BY_MEMORY)


def _leaf_fields(section: Any, prefix: str) -> list[str]:
    out: list[str] = []
    for name, info in section.model_fields.items():
        inner = info.annotation
        nested = isinstance(inner, type) and hasattr(inner, "model_fields")
        out += _leaf_fields(inner, f"{prefix}.{name}") if nested else [f"{prefix}.{name}"]
    return out


def _field_exists(path: str) -> bool:
    model: Any = RunConfig
    for part in path.split("."):
        info = getattr(model, "model_fields", {}).get(part)
        if info is None:
            return False
        model = info.annotation
    return True


def _dotted(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = key if key.startswith(f"{prefix}.") else f"{prefix}.{key}"
        out.update(_dotted(value, path) if isinstance(value, dict) and path != "memory.randomized_linear"
                   else {path: value})
    return out


def budget_plan(decided: Any, args: TrainingArguments, optimizer_changed: bool,
                user_checkpointing: bool, adapter: str = "full", applied: RunConfig | None = None,
                fixed: dict[str, Any] | None = None) -> BudgetPlan:
    """The planner's decision as a :class:`BudgetPlan`, with each change and its reason
    (``adapter``: what the plan trains, ``full`` or e.g. ``lora r=8``; ``applied``: the recipe with
    every field decided, whose :func:`patch_knobs` values are the settings; ``fixed``: what the
    user's ``memory=`` fixed)."""
    from memtrain.estimator.setup import recipe_value

    chosen = decided.settings()
    micro, accumulation = chosen["training.micro_batch_size"], chosen["training.gradient_accumulation"]
    values = {k.path: recipe_value(applied, k.path) if applied is not None else chosen.get(k.path, k.off)
              for k in patch_knobs()}
    mode = values.get("memory.checkpointing", "none")
    settings: dict[str, Any] = {"per_device_train_batch_size": micro,
                                "gradient_accumulation_steps": accumulation,
                                "optim": EIGHT_BIT_OPTIM if optimizer_changed else optim_name(args),
                                "checkpointing": mode, "loss": values.get("memory.loss", "standard"),
                                "adapter": adapter}
    turned_on = [k for k in patch_knobs() if k.path not in ("memory.checkpointing", "memory.loss")
                 and values[k.path] != k.off and values[k.path] is not None]
    settings.update({setting_name(k): values[k.path] for k in turned_on})
    changes: list[Change] = []
    if micro != args.per_device_train_batch_size:
        why = ("the largest micro-batch that fits; the accumulation makes up the rest, so your effective "
               "batch is unchanged")
        changes += [Change("per_device_train_batch_size", str(args.per_device_train_batch_size),
                           str(micro), why),
                    Change("gradient_accumulation_steps", str(args.gradient_accumulation_steps),
                           str(accumulation), "keeps per-device batch × accumulation")]
    if user_checkpointing:
        changes.append(Change("gradient_checkpointing", "True", f"False; memtrain's {mode} checkpointing",
                              "your checkpointing, done once by memtrain's patch (transformers' on top "
                              "would recompute every layer twice)"))
    elif mode != "none":
        changes.append(Change("checkpointing", "none", str(mode), "activations do not fit otherwise"))
    if optimizer_changed:
        changes.append(Change("optim", optim_name(args), EIGHT_BIT_OPTIM,
                              "nothing fits with your optimizer: 8-bit AdamW keeps its state in 2 bytes "
                              "per parameter instead of 8 (bitsandbytes)"))
    if settings["loss"] == "chunked":
        changes.append(Change("loss", "standard", "chunked", "the full logits of a step do not fit"))
    asked = set(memory_fields(fixed))
    for knob in turned_on:
        name = setting_name(knob)
        if knob.path in asked:
            why = "you asked for it (memory=)"
        elif not knob.exact:
            why = "allow_approximate=True: saves activation memory, with approximate gradients"
        else:
            why = f"the fastest setting that fits: {_trades(knob)}"
        changes.append(Change(name, "off" if knob.off in (False, None) else str(knob.off),
                              str(settings[name]), why))
    return BudgetPlan(decided.budget, decided.usable, decided.device, decided.chosen.peak, settings, changes)


def setting_name(knob: Knob) -> str:
    """A patch knob's name in :attr:`BudgetPlan.settings`: its recipe field below ``memory``."""
    return knob.path.removeprefix("memory.")


def _trades(knob: Knob) -> str:
    owner = next(t for t in patches.techniques() if knob in t.knobs)
    return owner.doc.trades if owner.doc is not None else owner.name


def nothing_fits(failures: list[tuple[str, Any]], total: int, margin: float, args: TrainingArguments,
                 user_checkpointing: bool, lora: bool = False,
                 by: str = "prepare_for_budget") -> MemtrainError:
    """The error when no optimizer tried fits: the smallest reachable peak and what reaches it;
    ``by`` names the call that planned (``attach``, when it re-plans for the Trainer's data)."""
    optimizer, err = min(failures, key=lambda f: f[1].smallest.min_peak)
    smallest = err.smallest
    values = dict(smallest.values)
    parts = [f"per_device_train_batch_size={smallest.micro}",
             f"gradient_accumulation_steps={smallest.accumulation}"]
    mode = values.pop("memory.checkpointing", "full" if user_checkpointing else "none")
    parts.append(f"checkpointing {mode}")
    optim = optim_name(args) if optimizer == planned_optimizer(args) else EIGHT_BIT_OPTIM
    parts.append(f"optim={optim!r}" + (" (8-bit AdamW)" if optim == EIGHT_BIT_OPTIM else ""))
    knobs = {k.path: k for k in patches.knobs()}
    on = [f"{setting_name(knobs[k]) if k in knobs else k.split('.')[-1]}={v!r}" for k, v in values.items()
          if k != "training.optimizer" and not (k in knobs and v == knobs[k].off)]  # what is turned on
    if on:
        parts.append(f"memory: {', '.join(on)}")
    usable = int(total * (1 - margin))
    needed = int(smallest.min_peak / (1 - margin)) + 1
    yours = min((e.smallest.min_peak for o, e in failures if o == planned_optimizer(args)), default=None)
    own = (f" (with your optim={optim_name(args)!r}: {format_bytes(yours)})"
           if yours is not None and optim != optim_name(args) else "")
    return MemtrainError(
        f"{by}: nothing fits budget={format_bytes(total)} ({format_bytes(usable)} usable with "
        f"margin={margin}). The smallest reachable peak is {format_bytes(smallest.min_peak)}, with "
        f"{', '.join(parts)}{own}. Fix: budget= of at least {format_bytes(needed)}, a shorter "
        "max_length=, allow_approximate=True, "
        + ("a smaller LoRA rank or fewer target modules, " if lora else "a LoRA adapter (peft), ")
        + "or a smaller model.")


def optim_name(args: TrainingArguments) -> str:
    """``args.optim`` as the plain string a user writes (TrainingArguments keeps an enum)."""
    return str(getattr(args.optim, "value", args.optim))


DEFAULT_LENGTH = 512  # tokens planned for when nothing says the length (capped by the model's positions)


def planned_length(model: nn.Module, args: TrainingArguments, max_length: int | None, rows: Any
                   ) -> tuple[int, str, list[str]]:
    """The row length to plan for, where it came from (:attr:`BudgetPlan.length_from`) and notes.

    A stated ``max_length=`` is the user's choice (over the model's positions it is an error);
    ``rows=`` is the data; ``args.max_length`` (TRL's configs, which cut rows there) and the
    assumed default are capped by the model's positions
    (:func:`memtrain.estimator.setup.position_limit`).
    """
    from memtrain.estimator.setup import position_limit

    inner = patches.base_model(model)
    limit = position_limit(inner.config)
    positions = f"the model's {limit} positions" if limit is not None else "no position limit in its config"
    if max_length is not None:  # (checked: at least 1; memtrain.plugin.checks)
        if limit is not None and max_length > limit:
            raise MemtrainError(f"prepare_for_budget: `max_length={max_length}` is more than the {limit} "
                                f"positions this model ({inner.config.model_type}) has. Fix: max_length= of "
                                f"at most {limit}, and rows cut to it.")
        return max_length, "max_length=", []
    if rows is not None:
        return rows.longest, "rows=", []
    stated = getattr(args, "max_length", None)
    if stated:
        if limit is not None and stated > limit:
            return limit, "args.max_length", [
                f"{type(args).__name__}.max_length={stated} is more than {positions}: planned for {limit} "
                "tokens (longer rows cannot be trained on this model)"]
        return stated, "args.max_length", []
    length = min(DEFAULT_LENGTH, limit) if limit is not None else DEFAULT_LENGTH
    why = (f"the model's {limit} positions" if length == limit else
           f"memtrain's default of {DEFAULT_LENGTH}, within {positions}")
    return length, "assumed", [
        f"no max_length= and no data to read yet: assumed rows of {length} tokens ({why}); "
        "memtrain.attach(trainer) re-plans for the longest batch of the Trainer's data through its collator"]
