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

:func:`generation_memory` is the generation phase's memory, **analytic** but for the prompts'
prefill, which is traced (one row's no-grad forward on fake tensors, :func:`prefill_per_row`): the
weights and optimizer state, the KV cache of every completion of a generation batch at prompt +
completion length, and the larger of the prompts' prefill and the sampling step's rows x vocabulary
fp32 tensors. TRL generates a whole generation batch at once (micro-batch x steps_per_generation
completions, HF ``generate``); :func:`generation_phase` applies it to a recipe,
:func:`trainer_generation_phase` to a user's ``GRPOTrainer``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memtrain import patches
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
    # (read uncut where the length is `auto`: the planned length cuts the prompts, not this check)
    if limit is not None and longest + completion > limit and cfg.data.max_length != "auto":
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


# Rows x vocabulary fp32 tensors alive at the sampling step's peak of HF ``generate`` (multinomial
# sampling): the fp32 copy of the last position's logits, the softmax probabilities, and two of
# torch.multinomial's for one sample (an exponential draw of the same size, the probabilities
# divided by it). Measured with scripts/probes/memprobe.py's LiveBytes (transformers 5.24, torch 2.13, CPU):
# 4.0 beyond the KV cache with no logits processor (the processors: PROCESSOR_EXTRA below).
# tests/end_to_end/test_grpo.py::test_the_generation_phase_is_predicted_within_10_percent.
SAMPLING_COPIES = 4
# Each logits processor HF ``generate`` runs while sampling (in its order) peaks at these rows x
# vocabulary fp32 tensors more than SAMPLING_COPIES (its own temporaries: a temperature's quotient;
# top-k's threshold mask and masked copy; top-p's sort, int64 indices, softmax, cumulative sum and
# masks; min-p's probabilities and mask; the repetition penalty's gather/scatter; typical-p's
# log-softmax, entropy, sort and cumulative sum; the minimum length's mask and masked copy), plus one
# more when it is not the first in the chain (the processed scores it was handed are alive beside the
# logits). Measured with scripts/probes/memprobe.py's LiveBytes around ``generate`` (transformers 5.24
# for the first five, 5.25 for the rest; torch 2.13, CPU; the same in units at 32 and 64 rows, every
# combination of the first five, the others alone and after a temperature or a repetition penalty):
# docs/bench/generation_processors.md (``python -m scripts run generation_processors``). The first
# five are the settings a recipe's ``training.grpo_*`` fields name; only TRL's ``generation_kwargs``
# set the rest (a user's GRPOConfig). HF's order: PROCESSOR_ORDER.
PROCESSOR_EXTRA = {"repetition_penalty": 2.0, "temperature": 1.0, "top_k": 1.25, "top_p": 5.5, "min_p": 2.25,
                   "no_repeat_ngram_size": 1.25, "min_length": 2.05, "min_new_tokens": 3.05, "top_h": 1.55,
                   "typical_p": 9.5, "epsilon_cutoff": 2.25, "eta_cutoff": 5.0}
PROCESSOR_ORDER = ("repetition_penalty", "no_repeat_ngram_size", "min_length", "min_new_tokens",
                   "temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                   "eta_cutoff")
# processors whose peak is the same wherever they are in the chain (measured after a repetition
# penalty: a minimum of new tokens peaks in its own temporaries, not beside the scores it was handed)
UNCHAINED = frozenset({"min_new_tokens"})
# generation settings whose logits processors the sampling step runs too, not counted (a note says
# so), with the values that leave them off (HF's conditions; any other value turns one on)
UNCOUNTED = {"guidance_scale": (None, 1, 1.0), "sequence_bias": (None,), "bad_words_ids": (None,),
             "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,),
             "forced_eos_token_id": (None,), "exponential_decay_length_penalty": (None,),
             "watermarking_config": (None,), "renormalize_logits": (None, False),
             "remove_invalid_values": (None, False)}


def sampling_processors(*, temperature: float | None = 1.0, top_k: int | None = 0,
                        top_p: float | None = 1.0, min_p: float | None = None,
                        repetition_penalty: float | None = 1.0, no_repeat_ngram_size: int | None = None,
                        min_length: int | None = None, min_new_tokens: int | None = None,
                        top_h: float | None = None, typical_p: float | None = None,
                        epsilon_cutoff: float | None = None, eta_cutoff: float | None = None
                        ) -> tuple[str, ...]:
    """The logits processors HF ``generate`` adds for these sampling settings (its own conditions:
    a temperature other than 1, ``top_k`` other than 0, ``top_p`` below 1, any ``min_p``, a
    repetition penalty other than 1, an n-gram size or a minimum length above 0, any ``top_h``,
    ``typical_p`` below 1, an epsilon or eta cutoff strictly between 0 and 1), in the order it runs
    them. A minimum length counts wherever it is set: HF runs it while the sequence is shorter
    (the first steps), and also needs an end-of-sequence id, which TRL's generation has."""
    def between(value: float | None) -> bool:
        return value is not None and 0.0 < value < 1.0

    on = {"repetition_penalty": repetition_penalty is not None and repetition_penalty != 1.0,
          "no_repeat_ngram_size": bool(no_repeat_ngram_size and no_repeat_ngram_size > 0),
          "min_length": bool(min_length and min_length > 0),
          "min_new_tokens": bool(min_new_tokens and min_new_tokens > 0),
          "temperature": temperature is not None and temperature != 1.0, "top_h": top_h is not None,
          "top_k": top_k is not None and top_k != 0, "top_p": top_p is not None and top_p < 1.0,
          "min_p": min_p is not None, "typical_p": typical_p is not None and typical_p < 1.0,
          "epsilon_cutoff": between(epsilon_cutoff), "eta_cutoff": between(eta_cutoff)}
    return tuple(name for name in PROCESSOR_ORDER if on[name])


def _left_off(value: Any, off: tuple[Any, ...]) -> bool:
    """``value`` is one of ``off``, by type too (a token id 0 is not ``False``)."""
    return any(value is o or (type(value) is type(o) and value == o) for o in off)


def sampling_copies(processors: tuple[str, ...] = ()) -> float:
    """Rows x vocabulary fp32 tensors at the sampling step's peak with ``processors`` (see
    :data:`PROCESSOR_EXTRA`): the largest of the plain step's and each processor's."""
    chain = [name for name in PROCESSOR_ORDER if name in processors]
    own = (PROCESSOR_EXTRA[name] + (i > 0 and name not in UNCHAINED) for i, name in enumerate(chain))
    return SAMPLING_COPIES + max(own, default=0.0)


@dataclass
class GenerationPhase:
    """The generation phase's memory: HF ``generate`` of one generation batch at full length
    (analytic but for the prefill; see :func:`generation_memory`)."""

    resident: int  # weights, buffers, optimizer state (gradients were freed by the last zero_grad)
    kv_cache: int  # every completion at prompt + completion length
    growth: int  # the last step's new key (or value) of one layer, concatenated to the old
    prefill: int  # the prompts' forward (per layer)
    sampling: int  # the sampling step's rows x vocabulary fp32 tensors
    sequences: int
    length: int
    processors: tuple[str, ...] = ()  # the logits processors the sampling step runs (HF's order)
    uncounted: tuple[str, ...] = ()  # generation settings whose processors run too, not counted

    @property
    def peak_bytes(self) -> int:
        return self.resident + self.kv_cache + self.growth + max(self.prefill, self.sampling)

    def describe(self) -> str:
        mib = 2**20
        return (f"GRPO generation phase (HF generate; the prefill traced, the rest analytic): "
                f"{self.peak_bytes / mib:,.2f} "
                f"MiB = weights and optimizer state {self.resident / mib:,.2f} + KV cache "
                f"{(self.kv_cache + self.growth) / mib:,.2f} ({self.sequences} completions x {self.length} "
                f"tokens) + the larger of the prompts' prefill {self.prefill / mib:,.2f} and the sampling "
                f"step's logits {self.sampling / mib:,.2f} MiB"
                + (f" (with {', '.join(self.processors)})" if self.processors else "")
                + (f"; not counted: the logits processors of {', '.join(self.uncounted)} (unmeasured; "
                   "the sampling step may peak higher)" if self.uncounted else ""))


def generation_memory(text: Any, *, resident: int, sequences: int, prompt: int, completion: int, size: int,
                      processors: tuple[str, ...] = ()) -> GenerationPhase:
    """HF ``generate`` of ``sequences`` rows (every prompt ``prompt`` tokens, left-padded, every
    completion ``completion`` tokens: the worst case) of a model with text config ``text`` whose
    weights are ``size`` bytes per value, beside ``resident`` bytes: the KV cache at full length in
    the weights' dtype (a ``DynamicCache``: each step concatenates one layer's new key and value to
    the old ones), the prompts' prefill (:func:`prefill_per_row` per row: a forward traced on fake
    tensors), and the sampling step (:func:`sampling_copies` fp32 tensors of
    rows x vocabulary for the logits ``processors`` of :func:`sampling_processors`)."""
    length = prompt + completion
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = kv_heads * head_dim * sequences * size  # one key or value tensor, one token
    tokens = cached_tokens(text, prompt, length)
    kv = 2 * per_token * sum(tokens)
    growth = per_token * max(tokens, default=0)  # the one tensor concatenated longer beside the old one
    traced = prefill_per_row(text, prompt, size)
    if traced is None:  # a model the fake forward cannot run: per token, a gated MLP's three
        # intermediate tensors, four hidden-size ones and the rotary tables (no attention scores)
        intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
        traced = prompt * (3 * intermediate + 4 * text.hidden_size + 2 * head_dim) * size
    prefill = sequences * traced
    sampling = math.ceil(sampling_copies(processors) * sequences * text.vocab_size * 4)
    return GenerationPhase(resident=resident, kv_cache=kv, growth=growth, prefill=prefill, sampling=sampling,
                           sequences=sequences, length=length, processors=tuple(processors))


_PREFILL: dict[tuple[str, str | None, int, int], int | None] = {}
PREFILL_KEPT = 64  # prefill traces cached (a long-lived process plans many configs and lengths)


def prefill_per_row(text: Any, prompt: int, size: int) -> int | None:
    """The bytes one row's prefill holds at its peak beyond the weights and the prompt: a no-grad
    forward of a ``prompt``-token row (left-padded, as a generation batch is; only the last token's
    logits, as ``generate`` asks) of the model of ``text`` at two layers (any later layer holds what
    the second does) on fake tensors, in the dtype of ``size`` bytes and the config's attention
    implementation, so that whatever a family's layers keep counts: a gated MLP's product, the
    rotary tables, eager attention's scores and softmax (rows x heads x prompt^2). Linear in the
    rows, so one row is traced; the cache (counted apart, at full length) is off, its keys and
    values counted here as well (more, never less). Cached per config, length and size (the
    :data:`PREFILL_KEPT` most recently used); None where the forward cannot run on fake tensors."""
    from memtrain._compat.transformers_config import attn_implementation

    attn = attn_implementation(text)
    key = (text.to_json_string(use_diff=False), attn, prompt, size)
    if key in _PREFILL:
        _PREFILL[key] = _PREFILL.pop(key)  # the most recently used last
    else:
        _PREFILL[key] = _traced_prefill(text, attn, prompt, size)
        while len(_PREFILL) > PREFILL_KEPT:
            del _PREFILL[next(iter(_PREFILL))]  # the least recently used
    return _PREFILL[key]


def _traced_prefill(text: Any, attn: str | None, prompt: int, size: int) -> int | None:
    import torch
    from transformers import AutoModelForCausalLM

    from memtrain._compat import transformers_model
    from memtrain.estimator.fake import fake_tensor_mode, quiet_libraries
    from memtrain.estimator.flash_standin import traced_attention
    from memtrain.estimator.trace import with_depth
    from memtrain.memory.meter import MemoryMeter

    dtype = torch.float32 if size >= 4 else torch.bfloat16
    config = with_depth(text, min(2, int(text.num_hidden_layers)))
    try:
        with fake_tensor_mode(), quiet_libraries():
            with transformers_model.uninitialized_values():
                # the user's kernel, said (FlashAttention as its stand-in: memtrain.estimator.flash_standin)
                chosen = {"attn_implementation": traced_attention(attn)} if attn else {}
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, **chosen).eval()
            ids = torch.zeros(1, prompt, dtype=torch.long)
            mask = torch.ones(1, prompt, dtype=torch.long)
            mask[:, 0] = 0
            with torch.no_grad(), MemoryMeter(model, inputs=[ids, mask], device="cpu") as meter:
                model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    except Exception:  # a family the fake forward cannot run: the caller's per-token count
        return None
    held = meter.result().peak_by_category
    return sum(v for k, v in held.items() if k not in ("parameters", "buffers", "inputs"))


def cached_tokens(text: Any, prompt: int, length: int) -> list[int]:
    """The tokens each layer's ``DynamicCache`` entry holds at most while ``generate`` grows prompts of
    ``prompt`` tokens to ``length``: all of them in a full-attention layer; in a sliding-window (or
    chunked) layer the window, or the prompt where it is longer (the prefill's keys stay whole until
    the first new token replaces them). Layer kinds as transformers' caches read them: the config's
    ``layer_types``, else every layer sliding where the config sets ``sliding_window``. Other kinds
    (linear attention's recurrent state, a layer without attention) are counted as full attention:
    their state is not modelled, and this is more."""
    layers = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    types = getattr(text, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(types) != layers:
        kind = "sliding_attention" if window else "chunked_attention" if chunk else "full_attention"
        types = [kind] * layers
    sizes = {"sliding_attention": window, "chunked_attention": chunk}
    return [min(length, max(prompt, sizes[kind])) if sizes.get(kind) else length for kind in types]


def generation_phase(cfg: RunConfig, prompt_tokens: int | None = None, micro_batch: int | None = None,
                     resident: int | None = None) -> GenerationPhase:
    """:func:`generation_memory` of a recipe: one generation call of ``micro_batch`` completions
    (default: the recipe's micro-batch x accumulation; TRL generates micro-batch x
    steps_per_generation at once, and memtrain sets steps_per_generation to the accumulation) after
    ``prompt_tokens``-token prompts (default ``data.max_length``), beside ``resident`` bytes
    (default: the weights alone; the estimate passes its trace's weights, buffers and optimizer
    state)."""
    config, _ = resolve_config(cfg.model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = _BYTES.get(cfg.model.dtype, 4)
    t = cfg.training
    if micro_batch is None and isinstance(t.micro_batch_size, int) and t.gradient_accumulation != "auto":
        from memtrain.config.batch import resolve_batch

        batch = resolve_batch(t)  # one process: GRPO runs in one (config/grpo_section.py)
        micro_batch = batch.micro * batch.accumulation  # micro-batch x steps_per_generation, at once
    micro = micro_batch or t.grpo_num_generations
    prompt = prompt_tokens if prompt_tokens is not None else (
        cfg.data.max_length if isinstance(cfg.data.max_length, int) else 512)
    held = _weight_bytes(config, dtype) if resident is None else resident
    return generation_memory(text, resident=held, sequences=micro, prompt=prompt,
                             completion=cfg.training.grpo_max_completion_length, size=dtype,
                             processors=sampling_processors(
                                 temperature=t.grpo_temperature, top_k=t.grpo_top_k, top_p=t.grpo_top_p,
                                 min_p=t.grpo_min_p, repetition_penalty=t.grpo_repetition_penalty))


def _weight_bytes(config: Any, dtype: int) -> int:
    """The policy's parameters, counted on a meta-device build of the config."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype


# ------------------------------------------------------------------ a user's GRPOTrainer (the plugin)


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


def phase_peaks(trainer: Any, step: Any) -> dict[str, int]:
    """The predicted peak of each phase of a GRPOTrainer's step, beside its traced training ``step``
    (a modelled :class:`~memtrain.estimator.trainer_loss.TrainerEstimate`): ``{"generation": ...,
    "training": ...}``; empty for another trainer, or where vLLM generates (its memory is not this
    step's: :mod:`memtrain.plugin.colocate` plans a colocated share apart)."""
    from memtrain._compat.trl import is_grpo

    if not is_grpo(trainer) or getattr(trainer.args, "use_vllm", False) or step.peak_bytes is None:
        return {}
    return {"generation": generation_beside(trainer, step).peak_bytes, "training": step.peak_bytes}


def generation_beside(trainer: Any, step: Any) -> GenerationPhase:
    """:func:`trainer_generation_phase` beside a traced training step ``step`` (a
    :class:`~memtrain.estimator.trainer_loss.TrainerEstimate`): what stays resident between the
    phases is the step's weights, buffers and optimizer state, and the prompts are as long as in the
    batch it traced."""
    resident = sum(step.by_category.get(name, 0) for name in ("parameters", "buffers", "optimizer_state"))
    return trainer_generation_phase(trainer, resident, step.batch["prompt_ids"][1])


def trainer_generation_phase(trainer: Any, resident: int, prompt: int) -> GenerationPhase:
    """The generation phase's peak for a user's ``GRPOTrainer``: :func:`generation_memory` of its
    generation batch (``generation_batch_size`` completions per process, generated at once) at
    ``prompt`` + ``max_completion_length`` tokens, beside ``resident`` bytes (weights, buffers,
    optimizer state; gradients were freed by the last ``zero_grad``), with the logits processors its
    sampling settings add (``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``; ``generation_kwargs`` over them, as TRL does).

    The processors of ``generation_kwargs`` HF runs while sampling are counted where measured
    (:data:`PROCESSOR_EXTRA`: also a minimum length, typical-p, epsilon and eta cutoffs, n-gram
    blocking, top-h); the others (:data:`UNCOUNTED`: bad words, suppressed tokens, a sequence bias,
    ...) are named in the phase's description, which the plan's notes carry.

    Not modelled: vLLM (``use_vllm``) and continuous batching (paged caches), which plan.notes
    name; the no-grad old-policy / reference log-prob passes after generation
    (``per_device_train_batch_size`` rows at a time, no activations kept for backward: below the
    traced training step).
    """
    import torch

    args = trainer.args
    model = trainer.model
    inner = patches.base_model(model)
    text = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    weight = next((p for p in inner.parameters() if p.is_floating_point()), None)
    dtype = weight.dtype if weight is not None else torch.float32
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        dtype = torch.bfloat16 if args.bf16 else torch.float16
    size = torch.empty(0, dtype=dtype).element_size()
    sequences = max(1, args.generation_batch_size // max(1, args.world_size))
    extra = getattr(args, "generation_kwargs", None) or {}  # TRL lets them override its own settings
    names = inspect.signature(sampling_processors).parameters
    settings = {name: extra.get(name, getattr(args, name, param.default)) for name, param in names.items()}
    # a setting that is not a number (a string from a config file) is HF's to refuse: named, not counted
    odd = {name for name, value in settings.items()
           if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)))}
    processors = sampling_processors(**{name: names[name].default if name in odd else value
                                        for name, value in settings.items()})
    phase = generation_memory(text, resident=resident, sequences=sequences, prompt=prompt,
                              completion=args.max_completion_length, size=size, processors=processors)
    phase.uncounted = tuple(sorted(odd)) + tuple(name for name, off in UNCOUNTED.items()
                                                 if not _left_off(extra.get(name), off))
    return phase
