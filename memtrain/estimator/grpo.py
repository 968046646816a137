"""``training.objective: grpo`` before the model loads: the checks that need TRL, the model's config
or the reward code, and what the estimate says of the generation phase.

:func:`check_grpo` runs at ``memtrain validate`` (with ``--data``: on the data too), at
``memtrain estimate`` / ``plan`` and at the start of ``memtrain train``; each mistake is a
:class:`~memtrain.errors.MemtrainError` (exit 2) naming its field and the fix:

- ``training.grpo_loss`` must be a loss type the installed TRL lists;
- every ``training.grpo_rewards`` entry must resolve (a ``module:function`` that imports), and, with
  the data read, return one number when called on the first row as TRL will call it;
- the longest prompt plus ``training.grpo_max_completion_length`` must fit the model's positions
  (:func:`memtrain.estimator.setup.position_limit`).

:func:`generation_phase` is the generation phase's memory, an **analytic** estimate (not traced):
the policy's weights, the KV cache of every completion of a generation micro-batch at prompt +
completion length, and the sampling step's logits in fp32. TRL generates the whole per-device
batch of completions at once (``per_device_train_batch_size`` sequences, HF ``generate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memtrain.config import RunConfig
from memtrain.errors import MemtrainError
from memtrain.estimator.setup import position_limit, resolve_config

if TYPE_CHECKING:
    from memtrain.data.prepare import PreparedData

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_grpo(cfg: RunConfig, data: PreparedData | None = None) -> None:
    """The GRPO checks of the module docstring (``data``: the prepared prompts, when read)."""
    from memtrain.trainer import rewards
    from memtrain.trainer.grpo import check_loss

    t = cfg.training
    check_loss(cfg)
    funcs = rewards.resolve(cfg)
    config, _ = resolve_config(cfg.model)
    limit = position_limit(config)
    completion = t.grpo_max_completion_length
    if limit is not None and completion >= limit:
        raise MemtrainError(f"`training.grpo_max_completion_length`: {completion:,} tokens leave no room for "
                            f"a prompt in the {limit:,} positions this model ({config.model_type}) has. Fix: "
                            f"set it below {limit}, e.g. {limit // 4}.")
    if data is None or len(data.train) == 0:
        return
    longest = max(data.train["prompt_tokens"])
    if limit is not None and longest + completion > limit:
        raise MemtrainError(
            f"`data.max_length`: the longest prompt has {longest:,} tokens; with "
            f"`training.grpo_max_completion_length` = {completion:,} a sequence would need "
            f"{longest + completion:,} "
            f"of the {limit:,} positions this model ({config.model_type}) has. Fix: set `data.max_length` to "
            f"{limit - completion} or less (longer prompts are dropped), or lower "
            "`training.grpo_max_completion_length`.")
    row = {k: v for k, v in data.train[0].items()}
    answer = row.get(t.grpo_answer_column)
    rewards.check_on_sample(funcs, t.grpo_rewards, row, "prompt", answer if isinstance(answer, str) else "")


@dataclass
class GenerationPhase:
    """The generation phase's memory (analytic; see the module docstring)."""

    weights: int
    kv_cache: int
    logits: int
    sequences: int
    length: int

    @property
    def peak_bytes(self) -> int:
        return self.weights + self.kv_cache + self.logits

    def describe(self) -> str:
        mib = 2**20
        return (f"generation phase (analytic estimate, not traced): {self.peak_bytes / mib:,.2f} MiB = "
                f"weights {self.weights / mib:,.2f} + KV cache {self.kv_cache / mib:,.2f} ({self.sequences} "
                f"completions x {self.length} tokens) + sampling logits {self.logits / mib:,.2f} MiB")


def generation_phase(cfg: RunConfig, prompt_tokens: int | None = None, micro_batch: int | None = None
                     ) -> GenerationPhase:
    """Weights + KV cache + fp32 logits of one generation call at full length (every completion
    ``grpo_max_completion_length`` tokens after a ``prompt_tokens`` prompt, default ``data.max_length``)."""
    config, _ = resolve_config(cfg.model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = _BYTES.get(cfg.model.dtype, 4)
    micro = micro_batch or (cfg.training.micro_batch_size if isinstance(cfg.training.micro_batch_size, int)
                            else cfg.training.grpo_num_generations)
    prompt = prompt_tokens if prompt_tokens is not None else (
        cfg.data.max_length if isinstance(cfg.data.max_length, int) else 512)
    length = prompt + cfg.training.grpo_max_completion_length
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = 2 * layers * kv_heads * head_dim * micro * length * dtype
    logits = micro * text.vocab_size * 4 * 2  # the last position's logits and their fp32 softmax
    return GenerationPhase(weights=_weight_bytes(config, dtype), kv_cache=kv, logits=logits,
                           sequences=micro, length=length)


def _weight_bytes(config: Any, dtype: int) -> int:
    """The policy's parameters, counted on a meta-device build of the config."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype


def grpo_notes(cfg: RunConfig) -> list[str]:
    """What ``memtrain estimate`` states of a GRPO recipe: the traced training phase is an
    approximation, the generation phase an analytic estimate beside it (never summed)."""
    t = cfg.training
    return [
        f"GRPO: the training phase above is traced as the causal-LM step of {t.micro_batch_size} rows "
        f"(completions) of data.max_length tokens, not TRL's GRPO loss: the old-policy / reference "
        f"log-prob passes (beta {t.grpo_beta}) and prompt + completion length "
        f"(+{t.grpo_max_completion_length}) are not modelled (an approximation)",
        generation_phase(cfg).describe() + "; a separate phase, not added to the training peak",
    ]
