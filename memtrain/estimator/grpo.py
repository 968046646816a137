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


# ------------------------------------------------------------------ a user's GRPOTrainer (the plugin)


def is_grpo(trainer: Any) -> bool:
    """Whether ``trainer`` is TRL's ``GRPOTrainer`` (or a subclass); False where TRL is not installed."""
    try:
        from trl import GRPOTrainer
    except ImportError:
        return False
    return isinstance(trainer, GRPOTrainer)


def longest_prompt(trainer: Any) -> int:
    """Tokens of the longest prompt of the Trainer's training set, tokenized as TRL's GRPOTrainer does
    (``processing_class(text=...)``; a conversation through its chat template with the generation
    prompt), padded to ``pad_to_multiple_of`` where the config sets it. A stream: its first 64 rows."""
    import itertools

    import torch
    from trl.data_utils import is_conversational

    dataset = trainer.train_dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        rows = list(itertools.islice(iter(dataset), 64))
        prompts = [r["prompt"] for r in rows]
    else:
        prompts = list(dataset["prompt"])
    if not prompts:
        raise ValueError("its training set has no prompts")
    tokenizer = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
        lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, **kwargs))
                   for p in prompts]
    else:
        lengths = [len(ids) for start in range(0, len(prompts), 1024)
                   for ids in tokenizer(text=prompts[start:start + 1024])["input_ids"]]
    longest = max(lengths)
    multiple = getattr(trainer.args, "pad_to_multiple_of", None)
    return -(-longest // multiple) * multiple if multiple else longest


def step_batch(trainer: Any, micro_batch: int, prompt: int | None = None) -> dict[str, Any]:
    """The worst case of one GRPO micro-batch as TRL's ``_generate_and_score_completions`` hands it to
    ``compute_loss``: ``micro_batch`` completions, each after the longest prompt
    (:func:`longest_prompt`, left-padded) and ``max_completion_length`` tokens long (none stops early),
    the advantages, the token count, the old-policy log-probabilities (TRL computes them when
    ``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation`` × ``num_iterations``)
    and the reference's (``beta`` ≠ 0). ``prompt``: the prompt length to assume instead of reading the
    Trainer's training set (the recipe estimate: ``data.max_length``, or the data's longest prompt)."""
    import torch

    args = trainer.args
    if prompt is None:
        prompt = longest_prompt(trainer)
    completion = args.max_completion_length
    multiple = getattr(args, "pad_to_multiple_of", None)
    if multiple:
        completion = -(-completion // multiple) * multiple
    rows = micro_batch
    batch: dict[str, Any] = {
        "prompt_ids": torch.ones(rows, prompt, dtype=torch.long),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.ones(rows, completion, dtype=torch.long),
        "completion_mask": torch.ones(rows, completion, dtype=torch.long),
        "advantages": torch.zeros(rows),
        "num_items_in_batch": torch.tensor(rows * completion),
    }
    every = args.steps_per_generation * getattr(trainer, "num_iterations", args.num_iterations)
    if args.gradient_accumulation_steps % every != 0:
        batch["old_per_token_logps"] = torch.zeros(rows, completion)
    if getattr(trainer, "beta", args.beta) != 0.0:
        batch["ref_per_token_logps"] = torch.zeros(rows, completion)
    return batch


@dataclass
class TrainerGeneration:
    """The generation phase of a user's GRPOTrainer, analytic (see :func:`trainer_generation_phase`)."""

    resident: int
    kv_cache: int
    prefill: int
    logits: int
    sequences: int
    length: int

    @property
    def peak_bytes(self) -> int:
        return self.resident + self.kv_cache + max(self.prefill, self.logits)

    def describe(self) -> str:
        mib = 2**20
        return (f"GRPO generation phase (HF generate; analytic, not traced): {self.peak_bytes / mib:,.2f} "
                f"MiB = weights and optimizer state {self.resident / mib:,.2f} + KV cache "
                f"{self.kv_cache / mib:,.2f} "
                f"({self.sequences} completions x {self.length} tokens) + the larger of the prompts' prefill "
                f"{self.prefill / mib:,.2f} and the sampling step's logits {self.logits / mib:,.2f} MiB")


def trainer_generation_phase(trainer: Any, resident: int, prompt: int) -> TrainerGeneration:
    """The generation phase's peak for a user's ``GRPOTrainer``: ``resident`` bytes (weights, buffers,
    optimizer state; gradients were freed by the last ``zero_grad``) plus HF ``generate`` on the
    generation batch (``generation_batch_size`` completions per process, generated at once): the
    KV cache of every completion at ``prompt`` + ``max_completion_length`` tokens in the weights'
    dtype, the prefill of the prompts (per layer: the MLP's two intermediate tensors and four hidden-size
    tensors per token), and the sampling step's logits (the last position: logits, scaled, softmax
    in fp32).

    Not modelled: vLLM (``use_vllm``) and continuous batching (paged caches), which plan.notes name;
    the no-grad old-policy / reference log-prob passes after generation (``per_device_train_batch_size``
    rows at a time, no activations kept for backward: below the traced training step).
    """
    import torch

    args = trainer.args
    model = trainer.model
    inner = getattr(model, "get_base_model", lambda: model)()
    text = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    weight = next((p for p in inner.parameters() if p.is_floating_point()), None)
    dtype = weight.dtype if weight is not None else torch.float32
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        dtype = torch.bfloat16 if args.bf16 else torch.float16
    size = torch.empty(0, dtype=dtype).element_size()
    sequences = max(1, args.generation_batch_size // max(1, args.world_size))
    length = prompt + args.max_completion_length
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = 2 * text.num_hidden_layers * kv_heads * head_dim * sequences * length * size
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    prefill = sequences * prompt * (2 * intermediate + 4 * text.hidden_size) * size
    logits = 3 * sequences * text.vocab_size * 4
    return TrainerGeneration(resident=resident, kv_cache=kv, prefill=prefill, logits=logits,
                             sequences=sequences, length=length)
