"""The user's own Trainer options, one rule each: modelled by the estimate, or said not to be.

``prepare_for_budget`` describes a user's model and ``TrainingArguments`` to memtrain's estimator,
and ``attach`` traces the Trainer's own step. Some options a Trainer script sets change the memory
of a step in ways neither sees. None of them may be dropped or changed without a word: each
option below is a :class:`Rule` that either says how the estimate models it, or says, in the
plan's notes (``model.memtrain_plan.notes``, printed with the plan), that it is **not modelled**
and what that means for the predicted peak.

:data:`RULES` is the one list (``tests/plugin/test_plugin_length.py`` runs every entry); a new option
is a new entry. :func:`option_notes` applies it to what the plugin sees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from memtrain import patches
from memtrain._compat.transformers_config import attn_implementation

# TrainingArguments.optim -> memtrain's training.optimizer (the inverse of
# memtrain.trainer.trainer.OPTIMIZERS); any other optim is planned as STAND_IN_OPTIMIZER
OPTIM_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_bnb_8bit": "adamw_8bit",
               "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
               "adafactor": "adafactor", "sgd": "sgd"}
STAND_IN_OPTIMIZER = "adamw"
# memtrain's recipe field model.attn_implementation; a Hub FlashAttention kernel is planned as
# flash_attention_2 (the estimator's stand-in for any: memtrain.estimator.flash_standin)
MODELLED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class Seen:
    """What the plugin sees of the user's script: arguments, model and (at ``attach``) the collator
    and the Trainer."""

    args: Any
    model: Any
    collator: Any = None
    trainer: Any = None


@dataclass(frozen=True)
class Rule:
    """One Trainer option: its value where the script sets it (None: not set), and the note."""

    option: str
    modelled: bool
    value: Callable[[Seen], Any]
    note: Callable[[Any], str]

    def says(self, seen: Seen) -> str | None:
        found = self.value(seen)
        if found is None:
            return None
        head = "modelled" if self.modelled else "not modelled"
        return f"{self.option}={found!r}: {head}: {self.note(found)}"


def _arg(name: str, unset: Any = (None, False, 0, "")) -> Callable[[Seen], Any]:
    def value(seen: Seen) -> Any:
        found = getattr(seen.args, name, None)
        return None if found in unset else found

    return value


def _optim(seen: Seen) -> Any:
    name = str(getattr(seen.args.optim, "value", seen.args.optim))
    return None if name in OPTIM_NAMES else name


def _checkpointing_kwargs(seen: Seen) -> Any:
    on = any(bool(getattr(seen.args, n, False))
             for n in ("gradient_checkpointing", "activation_checkpointing"))
    kwargs = getattr(seen.args, "gradient_checkpointing_kwargs", None) or getattr(
        seen.args, "activation_checkpointing_kwargs", None)
    return kwargs if on and kwargs else None


def _attention(modelled: bool) -> Callable[[Seen], Any]:
    def value(seen: Seen) -> Any:
        inner = patches.base_model(seen.model)
        found = attn_implementation(inner.config)
        if found is None or found == "sdpa":  # the estimator's default: nothing to say
            return None
        return found if (_modelled(found) is not None) == modelled else None

    return value


def _hub_kernels(seen: Seen) -> Any:
    """True where transformers swapped the model's layers for Hub kernels (its public ``use_kernels``,
    on by default in ``from_pretrained`` from 5.25)."""
    return True if getattr(patches.base_model(seen.model), "use_kernels", False) is True else None


def _flattening(seen: Seen) -> Any:
    name = type(seen.collator).__name__ if seen.collator is not None else None
    return name if name == "DataCollatorWithFlattening" else None


def _grpo(name: str, unset: Any = (None, False, 0, "")) -> Callable[[Seen], Any]:
    """A TRL ``GRPOConfig`` field (one that only GRPO's config has, ``num_generations`` marks it)."""
    def value(seen: Seen) -> Any:
        args = seen.args
        if getattr(args, "num_generations", None) is None or not hasattr(args, "generation_batch_size"):
            return None
        found = getattr(seen.args, name, None)
        return None if found in unset else found

    return value


def _separate_reference(seen: Seen) -> Any:
    """A Trainer holding a reference model of its own (TRL's ``ref_model``: DPO, GRPO with beta > 0
    and no peft adapter): its class name."""
    reference = getattr(seen.trainer, "ref_model", None) if seen.trainer is not None else None
    return type(reference).__name__ if reference is not None else None


class _Generations(NamedTuple):
    """GRPOConfig's generation shape; shown as ``num_generations``."""

    num_generations: int
    max_completion_length: int
    generation_batch_size: int

    def __repr__(self) -> str:
        return str(self.num_generations)


def _generations(seen: Seen) -> Any:
    found = _grpo("num_generations")(seen)
    args = seen.args
    if found is None:
        return None
    return _Generations(found, args.max_completion_length, args.generation_batch_size)


def _generation_note(found: _Generations) -> str:
    return ("GRPO: per_device_train_batch_size counts completions; attach traces TRL's own training step "
            "(its compute_loss on a micro-batch of completions after the longest prompt, every one "
            f"max_completion_length={found.max_completion_length} tokens long, with the old-policy and "
            "reference log-probabilities it is handed); the generation phase (HF generate of "
            f"generation_batch_size={found.generation_batch_size} completions at once: KV cache, "
            "prefill, sampling logits) is an analytic estimate, not traced; the predicted peak is the "
            "larger of the two")


RULES: tuple[Rule, ...] = (
    Rule("torch_compile", False, _arg("torch_compile"), lambda _: (
        "the estimate traces the eager step; a compiled step fuses operations (usually fewer "
        "activations held, so the prediction errs high) and adds compile-time workspaces it does not "
        "count")),
    Rule("use_liger_kernel", False, _arg("use_liger_kernel"), lambda _: (
        "Liger's Triton kernels (fused RMSNorm, SwiGLU, linear cross-entropy) replace the model's layers "
        "inside train(); the prediction is for the stock layers (with the fused cross-entropy the full "
        "logits are never held, so it errs high)")),
    Rule("gradient_checkpointing_kwargs", True, _checkpointing_kwargs, lambda _: (
        "your checkpointing is planned as memtrain's full checkpointing (non-reentrant "
        "torch.utils.checkpoint per layer), which replaces transformers' own: these keyword arguments "
        "are not passed on")),
    Rule("attn_implementation", True, _attention(True), lambda found: (
        f"traced with the model's {found} attention" + (
            " (eager keeps an s x s matrix of scores per head for backward)" if found == "eager" else
            " (as memtrain's stand-in for FlashAttention, which keeps what it keeps: no s x s matrix)"))),
    Rule("attn_implementation", False, _attention(False), lambda _: (
        "planned with the model's default attention (SDPA where transformers has it for the model, else "
        "eager): a flex kernel keeps no s x s matrix, as SDPA's flash kernels; where the trace takes "
        "SDPA's math path (a CPU with attention dropout) or eager's, the prediction errs high")),
    Rule("use_kernels", False, _hub_kernels, lambda _: (
        "transformers swapped the model's layers for kernels from the Hugging Face Hub (from_pretrained's "
        "default from transformers 5.25): the estimate traces the layers the model defines, and memtrain's "
        "patches replace those; load it with use_kernels=False to train what is planned")),
    Rule("neftune_noise_alpha", False, _arg("neftune_noise_alpha"), lambda _: (
        "NEFTune's noise is added to the embeddings' output inside train(): one more batch x tokens x "
        "hidden tensor per forward, not in the prediction")),
    Rule("optim", False, _optim, lambda _: (
        f"memtrain does not build this optimizer: planned as {STAND_IN_OPTIMIZER}'s state, two fp32 "
        "values per trained parameter (an optimizer with more state is under-estimated); "
        "attach(trainer, estimate=True) traces the Trainer's own create_optimizer instead")),
    Rule("padding_free", True, _arg("padding_free"), lambda _: (
        "planned as packed rows (position ids restart, no padding); attach traces TRL's own step")),
    Rule("num_generations", True, _generations, _generation_note),
    Rule("use_vllm", False, _grpo("use_vllm"), lambda _: (
        "vLLM generates the completions: colocated, its share of the GPU (vllm_gpu_memory_utilization: its "
        "own copy of the weights and its KV cache) is planned in bytes and training into the rest "
        "(memtrain.plugin.colocate); in server mode it is another process's. The predicted peak is the "
        "training step's, HF generate's phase does not apply")),
    Rule("use_transformers_continuous_batching", False, _grpo("use_transformers_continuous_batching"),
         lambda _: ("transformers' continuous batching keeps a paged KV cache sized by its own config; the "
                    "generation phase predicted is HF generate's dynamic cache")),
    Rule("ref_model", True, _separate_reference, lambda found: (
        f"the Trainer holds a reference model of its own ({found}, a second copy of the weights): attach "
        "traces the Trainer's own step, so the predicted peak counts that copy's weights and its forward "
        "(with a peft adapter TRL's reference is the adapter turned off: no copy)")),
    Rule("data_collator", True, _flattening, lambda _: (
        "a batch is one row of sequences: attach traces the Trainer's step on the collator's longest "
        "batch and picks the micro-batch from that trace")),
)


def option_notes(seen: Seen, only: Callable[[Rule], bool] = lambda rule: True) -> list[str]:
    """One note per option of :data:`RULES` the script sets (those ``only`` selects)."""
    return [note for rule in RULES if only(rule) and (note := rule.says(seen)) is not None]


def planned_optimizer(args: Any) -> str:
    """memtrain's ``training.optimizer`` for ``args.optim`` (the stand-in for one it does not build)."""
    return OPTIM_NAMES.get(str(getattr(args.optim, "value", args.optim)), STAND_IN_OPTIMIZER)


def planned_attention(model: Any) -> str | None:
    """memtrain's ``model.attn_implementation`` for the user's model (None: the estimator's default)."""
    inner = patches.base_model(model)
    return _modelled(attn_implementation(inner.config))


def _modelled(found: str | None) -> str | None:
    """The recipe's ``model.attn_implementation`` for the kernel a model runs (None: not modelled)."""
    from memtrain.model import is_flash

    if found in MODELLED_ATTENTION:
        return found
    return "flash_attention_2" if is_flash(found) else None
