"""Chunked loss: the output head and cross-entropy over chunks of tokens, never full logits.

Saves: a causal LM's loss normally holds the logits of every token over the whole vocabulary
(batch × tokens × vocabulary), several times: the head's output, its fp32 upcast, the softmax
kept for backward and the gradient of each. With Llama-3's 128,256-token vocabulary at 2 × 2048
tokens that is 2 GiB per fp32 copy, more than a 4-bit 1B model. Here the final hidden states are
cut into chunks; each chunk runs the head and the cross-entropy under non-reentrant
``torch.utils.checkpoint``, which keeps only the chunk's hidden states and labels and recomputes
the chunk's logits in backward. At most one chunk's logits exist at any moment.

Costs: the head's forward runs twice (once more in backward): 2 × tokens × hidden × vocabulary
FLOPs, about 3% of a Llama-3.1-8B step, more for small models with large vocabularies.

Exact: the loss is the sum of per-chunk summed cross-entropies divided by the number of trained
tokens (or by the Trainer's ``num_items_in_batch`` under gradient accumulation), which is the
model's own ``ForCausalLMLoss``: labels shifted left by one with ``-100`` appended, ``-100``
ignored, logits upcast to fp32. Logit soft-capping (Gemma 2/3), Cohere's ``logit_scale`` and
Granite's ``logits_scaling`` are applied per chunk as the models do. With labels the output
carries the loss only (``logits`` is None); without labels (generation) the model's own forward
runs unchanged.

The chunk size starts from Liger-Kernel's fused linear cross-entropy rule, ``tokens /
ceil(vocabulary / hidden)`` tokens per chunk (one chunk's logits about as large as the hidden
states), bounded on both sides in bytes of fp32 logits: at least ``MIN_CHUNK_BYTES`` (small models
would otherwise get chunks of a few tokens, and a much slower step) and at most
``MAX_CHUNK_BYTES`` (at long contexts Liger's rule grows with the length: 2 GiB of fp32 logits per
chunk at 128k tokens of Llama-3; the cap keeps the loss's temporaries constant beyond 16k tokens).
The tokens are then cut into equal chunks no larger than that, so the chunk, and the estimate, grow
smoothly with the length (an earlier power-of-two rounding doubled the chunk one token past 2^k).
Liger's and Cut Cross-Entropy's fused kernels need Triton on CUDA; this pure-PyTorch version runs
everywhere (CPU tests, fake-tensor estimates) and is what the estimator traces.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast

from memtrain.config import RunConfig
from memtrain.config.base import decided
from memtrain.errors import MemtrainError
from memtrain.memory import loops
from memtrain.patches import LOSS, Doc, Knob, ModelShape, PatchRecord, add_records, base_model, register

IGNORE_INDEX = -100
_MARK = "_memtrain_chunked_loss"


# Chunks smaller than this many fp32 logit bytes cost more in per-chunk overhead than they save:
# measured on the tiny-llama recipe (hidden 128), Liger's rule alone gave 16-token chunks and a
# step 2.5x slower than the standard loss on a CPU (docs/bench/floor_cpu.md).
MIN_CHUNK_BYTES = 32 * 2**20
# Chunks larger than this many fp32 logit bytes are cut: beyond it a chunk only adds temporaries
# (about four fp32 copies of its logits in backward). 256 MiB is 523 tokens of Llama-3's 128,256
# vocabulary, whose head matmul (523 x 4096 x 128,256) still keeps a GPU busy.
MAX_CHUNK_BYTES = 256 * 2**20


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: Liger-Kernel's rule (logits about the size of the hidden states), kept
    between ``MIN_CHUNK_BYTES`` and ``MAX_CHUNK_BYTES`` of fp32 logits, then evened out: the
    tokens are cut into as few equal chunks as that size allows (the last one is not a sliver),
    never below the floor."""
    floor = math.ceil(MIN_CHUNK_BYTES / (4 * vocab))
    cap = max(floor, MAX_CHUNK_BYTES // (4 * vocab))
    size = min(max(math.ceil(tokens / max(1, math.ceil(vocab / hidden))), floor), cap)
    chunks = max(1, math.ceil(tokens / size))
    return max(1, math.ceil(tokens / chunks), min(floor, tokens))


def logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a model does to the head's output before its loss (identity for most)."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    divide = getattr(config, "logits_scaling", None)  # Granite divides

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module,
                          transform: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                          num_items_in_batch: torch.Tensor | int | None = None,
                          chunk: int | None = None, shift: bool = True) -> torch.Tensor:
    """The causal-LM loss of ``head(hidden)`` against ``labels``, computed chunk by chunk.

    Args:
        hidden: final hidden states, ``(batch, tokens, hidden)``.
        labels: ``(batch, tokens)`` token ids, ``-100`` where no loss is taken.
        head: the output layer (any module mapping hidden states to logits).
        transform: applied to each chunk's logits before the loss (soft-capping, scaling).
        num_items_in_batch: divide the summed loss by this (the Trainer's count over all
            accumulated micro-batches) instead of this batch's trained tokens.
        chunk: tokens per chunk (default: :func:`chunk_tokens`).
        shift: labels are the input ids (shift left by one, as the model's loss does).
    """
    if shift:
        labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1).to(flat.device)
    size = chunk or chunk_tokens(flat.shape[0], flat.shape[-1], _out_features(head))

    def piece(h: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
        with loops.step("chunked_loss", k, flat.shape[0], size):  # also when backward recomputes it
            logits = transform(head(h).float())
            return nn.functional.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")

    total = None
    for k in loops.indices(-(-flat.shape[0] // size)):
        start = k * size
        h, y = flat[start:start + size], targets[start:start + size]
        part = (checkpoint(piece, h, y, k, use_reentrant=False, preserve_rng_state=False)
                if torch.is_grad_enabled() else piece(h, y, k))
        total = part if total is None else total + part
    loops.done()
    assert total is not None
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _out_features(head: nn.Module) -> int:
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(head.out_features)


# fp32 logit bytes per loss chunk the planner tries around the rule (None: 32-256 MiB): larger chunks
# make fewer head and cross-entropy calls (faster), smaller ones keep less while the loss is the peak
CHUNK_BYTES = (2**30, None, 8 * 2**20)


@dataclass(frozen=True)
class Config:
    """Tokens per loss chunk (None: :func:`chunk_tokens`' rule for the batch's length)."""

    chunk_tokens: int | None = None


def chunk_ladder(vocab: int) -> list[int | None]:
    """The loss chunk sizes the planner tries, most memory first: chunks of 1 GiB of fp32 logits,
    the rule (null: 32-256 MiB), chunks of 8 MiB; sizes in tokens of a ``vocab``-word vocabulary.

    The rule keeps a chunk between 32 and 256 MiB of fp32 logits whatever the length, so the
    ladder's order is an order in memory at every length (what the planner's rank needs)."""
    if not vocab:
        return [None]
    return [None if size is None else max(1, size // (4 * vocab)) for size in CHUNK_BYTES]


def chunk_rank(value: int | None, shape: ModelShape) -> tuple[int, ...]:
    """Memory order of a chunk size: above the rule's cap (256 MiB of logits) < the rule (None) <
    below its floor; ``shape.vocab`` places a size around the rule."""
    if value is None:
        return (1,)
    logits = 4 * int(value) * shape.vocab
    return (0,) if logits > MAX_CHUNK_BYTES else (2,) if logits < MIN_CHUNK_BYTES else (1,)


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside ``model`` (also through a peft wrapper)."""
    inner = base_model(model)
    return inner


def apply(model: nn.Module, config: Config | int | None = None) -> nn.Module:
    """Make the causal LM compute its loss in chunks (see the module docstring); returns ``model``.
    ``config``: a :class:`Config` or its ``chunk_tokens`` alone (None: the rule).

    Raises:
        MemtrainError: the model has no linear output head or decoder to call, or adds a loss
            term of its own (a mixture-of-experts router loss).
    """
    chunk = config.chunk_tokens if isinstance(config, Config) else config
    lm = causal_lm(model)
    if getattr(lm, _MARK, False):
        return model  # already patched (prepare_for_budget run twice on one model)
    decoder = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    config = getattr(lm, "config", None)
    if decoder is None or head is None or decoder is lm:
        raise MemtrainError(
            f"`memory.loss`: chunked loss needs a causal LM with a decoder and an output head; "
            f"{type(lm).__name__} has {'no output head' if head is None else 'no separate decoder'}. "
            "Fix: set `memory.loss: standard`.")
    if getattr(config, "output_router_logits", False):
        raise MemtrainError(
            "`memory.loss`: this mixture-of-experts model adds its router loss to the loss, which "
            "the chunked loss does not compute. Fix: set `memory.loss: standard`.")
    transform = logit_transform(config)
    original = lm.forward

    def forward(self: nn.Module, input_ids: Any = None, attention_mask: Any = None,
                labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                **kwargs: Any) -> Any:
        if labels is None:  # generation or logits wanted: the model's own forward
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return original(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs.setdefault("use_cache", False)  # a cache of every layer's keys and values: not for training
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        loss = chunked_cross_entropy(out[0], labels, head, transform, num_items_in_batch, chunk)
        return CausalLMOutputWithPast(
            loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
            hidden_states=getattr(out, "hidden_states", None), attentions=getattr(out, "attentions", None))

    lm.forward = types.MethodType(forward, lm)
    setattr(lm, _MARK, True)

    def undo() -> None:
        del lm.forward
        delattr(lm, _MARK)

    add_records(model, [PatchRecord("chunked_loss", [type(lm).__name__],
                                    f"chunked loss ({chunk or 'auto'} tokens per chunk)", undo)])
    return model


def standard_loss_floor(cfg: RunConfig, shape: ModelShape, value: Any, micro: int) -> int:
    """Device bytes the standard loss keeps at least for ``micro`` rows of ``data.max_length``
    tokens in a causal LM's SFT step: two float32 tensors of every position's logits at once.
    transformers' causal-LM loss upcasts the logits (``logits.float()``: a copy, unless the head
    already returns float32) and cross-entropy's ``log_softmax`` writes its float32 output while
    reading them: 8 bytes per position and vocabulary entry, one position per row short (the last
    predicts nothing), whatever checkpointing or offload does around it. (The head's own bf16
    logits are left out: a head in float32 has none.) 0 for the chunked loss, and for other tasks
    and objectives (DPO's and GRPO's losses are TRL's, over the completion's tokens)."""
    if value != "standard" or cfg.model.task != "causal-lm" or cfg.training.objective != "sft":
        return 0
    return micro * (int(cfg.data.max_length) - 1) * shape.vocab * 8


KNOBS = (
    # DPO's loss is TRL's tiled log-prob head, not the model's loss
    Knob("memory.loss", lambda cfg, shape: (["standard", "chunked"] if cfg.model.task == "causal-lm"
                                            and cfg.training.objective == "sft" else ["standard"]),
         "standard", order=100, plugin=True, patches_model=True, floor=standard_loss_floor,
         holds_same=True),
    # a size whose default (None) sits inside its memory order: a size other than the default counts
    # as one more technique, so ties keep the default. The cost model predicts the loss chunks equal
    # (same FLOPs); measured, a quarter of the rule's chunk took 1.07x the rule's step and one chunk
    # of everything 0.95x, at 1.8x its peak (docs/bench/loss_chunk.md, a 2-core CPU)
    Knob("memory.loss_chunk_tokens", lambda cfg, shape: chunk_ladder(shape.vocab), None, order=110,
         rank=chunk_rank, plugin=True, sizes="memory.loss", holds_same=True),
)
DOC = Doc("chunked loss",
          "`memory.loss: chunked`, `memory.loss_chunk_tokens: auto` (chunk sized from the budget)",
          "never holds full-vocabulary logits; exact",
          "[floor.md](docs/bench/floor.md), [loss_chunk.md](docs/bench/loss_chunk.md)")


@register("chunked_loss", LOSS, "memory.loss", config=Config, apply=apply, knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if decided(cfg.memory.loss, "memory.loss", "standard or chunked") != "chunked":
        return None
    return apply(model, Config(decided(cfg.memory.loss_chunk_tokens, "memory.loss_chunk_tokens",
                                       "a number or null")))
