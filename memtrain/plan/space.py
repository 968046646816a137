"""The planner's candidate space: which values each ``auto`` field can take, in memory order.

A *candidate* (:class:`Candidate`) is one combination of values for the ``auto`` fields of a
recipe. :func:`_options` lists a field's values from "keeps most memory" to "keeps least" and
:func:`_rank` places a value in that order (the search prunes by it, see
:mod:`memtrain.plan.planner`). :func:`with_values` sets dotted fields on a recipe and re-validates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memtrain.config import RunConfig
from memtrain.config.batch import Batch, resolve_batch, valid_batches
from memtrain.estimator.setup import NEEDS_VALUE, recipe_value, resolve_config
from memtrain.patches.chunked_loss import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES

# Candidate values of each `auto` field, from "keeps most memory" to "keeps least" (see dominance).
APPROX_RANDOMIZED = {"ratio": 0.2, "sketch": "gaussian", "targets": None}
IN_BACKWARD = "training.optimizer_in_backward"
TILE_TOKENS = "memory.tiled_mlp_tile_tokens"
CHUNK_TOKENS = "memory.loss_chunk_tokens"
# fp32 logit bytes per loss chunk the planner tries around the rule (None: 32-256 MiB): larger chunks
# make fewer head and cross-entropy calls (faster), smaller ones keep less while the loss is the peak
CHUNK_BYTES = (2**30, None, 8 * 2**20)
# sizes whose default (None) sits inside their memory order: the tie rule counts a size other than
# the default as one more technique, so ties keep the default. The cost model predicts the loss
# chunks equal (same FLOPs); measured, a quarter of the rule's chunk took 1.07x the rule's step and
# one chunk of everything 0.95x, at 1.8x its peak (docs/bench/loss_chunk.md, a 2-core CPU)
SIZES = (CHUNK_TOKENS,)


@dataclass
class Candidate:
    """One combination of values for the ``auto`` fields, with its predictions."""

    values: dict[str, Any]  # dotted field -> value (the `auto` fields only)
    micro: int = 0
    accumulation: int = 0
    peak: int = 0  # predicted device bytes (tensors + CUDA overheads) at the chosen micro-batch
    seconds: float = math.inf  # predicted seconds per optimizer step
    parts: dict[str, float] = field(default_factory=dict)
    min_peak: int = 0  # predicted peak at the smallest micro-batch
    host: int = 0  # predicted host bytes (offloaded tensors) at the chosen micro-batch, else the smallest
    reason: str = ""  # why it was not chosen
    measured: float | None = None  # seconds of a real step, when the plan was tuned

    def label(self) -> str:
        shown = dict(self.values)
        if self.micro:
            shown.update(micro=self.micro, accumulation=self.accumulation)
        return ", ".join(f"{k.split('.')[-1] if k != 'memory.offload.activations' else 'offload_act'}"
                         f"={_show(v)}" for k, v in shown.items())


def auto_fields(cfg: RunConfig) -> list[str]:
    """The dotted fields of ``cfg`` the planner must decide."""
    paths = [*NEEDS_VALUE, "distributed.sharding", "data.max_length"]
    return [p for p in paths if recipe_value(cfg, p) == "auto"]


def with_values(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """A re-validated copy of ``cfg`` with dotted fields set.

    Raises:
        ValueError: the combination is invalid (e.g. a quantized base trained in full).
    """
    data = cfg.model_dump(mode="json")
    for path, value in values.items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    context: dict[str, Any] = {"problems": []}
    new = RunConfig.model_validate(data, context=context)
    if context["problems"]:
        raise ValueError("; ".join(str(p) for p in context["problems"]))
    return new


def _options(cfg: RunConfig, path: str, depth: int) -> list[Any]:
    """Candidate values of one `auto` field, from most memory kept to least."""
    if path == TILE_TOKENS:  # built only when asked: it reads the model's config
        return [None, *tile_ladder(cfg)]
    if path == CHUNK_TOKENS:
        return chunk_ladder(cfg)
    approx = cfg.memory.allow_approximate
    return {
        "model.quantization": ["none", "nf4"],
        # DPO's reference is the base with the adapter disabled: a LoRA run (config/checks.py)
        "adapter.method": ["lora"] if cfg.training.objective == "dpo" else ["full", "lora"],
        "training.optimizer": ["adamw", "adamw_8bit"],
        "memory.checkpointing": ["none", "selective", max(1, depth // 2), "full"],
        "memory.offload.activations": [False, True],
        "memory.offload.optimizer": [False, True] if cfg.distributed.processes == 1 else [False],
        # the frozen input table on the host (one process: FSDP2 shards it instead)
        "memory.offload.embeddings": [False, True] if cfg.distributed.processes == 1 else [False],
        "memory.activation_bits": [None, 3] if approx else [None],
        "memory.randomized_linear": [None, APPROX_RANDOMIZED] if approx else [None],
        # one process: nothing to shard; `grad_op` keeps at least what `full` keeps
        "distributed.sharding": ["none", "grad_op", "full"] if cfg.distributed.processes > 1 else ["none"],
        # DPO's loss is TRL's tiled log-prob head, not the model's loss
        "memory.loss": (["standard", "chunked"] if cfg.model.task == "causal-lm"
                        and cfg.training.objective == "sft" else ["standard"]),
        "training.optimizer_in_backward": [False, True],
        "memory.tiled_mlp": [False, True],  # keeps only each MLP's input; one more MLP forward
        "memory.lean_norm": [False, True],  # keeps each norm's input and rstd; element-wise recompute
        "training.dpo_precompute_ref": [False, True],  # no reference forward in the step
    }[path]


def tile_ladder(cfg: RunConfig) -> list[int]:
    """The MLP tile sizes below the default (``hidden_size`` tokens) the planner tries: a quarter
    and a sixteenth of it (one tile's intermediate exists at a time; 4-bit weights are dequantized
    once per tile and pass, so smaller tiles are slower)."""
    hidden = int(getattr(resolve_config(cfg.model)[0], "hidden_size", 0) or 0)
    return sorted({max(1, hidden // 4), max(1, hidden // 16)}, reverse=True) if hidden else []


def chunk_ladder(cfg: RunConfig) -> list[int | None]:
    """The loss chunk sizes the planner tries, most memory first: chunks of 1 GiB of fp32 logits,
    the rule (null: 32-256 MiB), chunks of 8 MiB; sizes in tokens of this model's vocabulary.

    The rule keeps a chunk between 32 and 256 MiB of fp32 logits whatever the length, so the
    ladder's order is an order in memory at every length (what :func:`_rank` needs)."""
    vocab = int(getattr(resolve_config(cfg.model)[0], "vocab_size", 0) or 0)
    if not vocab:
        return [None]
    return [None if size is None else max(1, size // (4 * vocab)) for size in CHUNK_BYTES]


def _rank(path: str, value: Any, depth: int, vocab: int = 0) -> tuple[int, ...]:
    """Position of ``value`` in its field's memory order, as a vector (checkpointing is 2-D:
    selective and n-of-L are not comparable); ``vocab`` places a loss chunk size around the rule."""
    if path == "memory.checkpointing":
        return {"none": (0, 0), "selective": (1, 0), "full": (1, 1)}.get(value, (0, 1))  # type: ignore[arg-type]
    if path == "model.quantization":
        return (0,) if value == "none" else (1,)
    if path == "adapter.method":
        return (0,) if value == "full" else (1,)
    if path == "training.optimizer":
        return (0,) if value == "adamw" else (1,)
    if path == "distributed.sharding":
        # `grad_op` keeps at least what `full` keeps. Replicas are comparable with neither: with a
        # frozen base (LoRA) a process gathers the whole model under `grad_op`, more than one
        # replica holds, while full fine-tuning holds far more as replicas.
        return {"none": (0, 1), "grad_op": (1, 0), "full": (2, 0)}[value]
    if path == "memory.loss":
        return (0,) if value == "standard" else (1,)
    if path == CHUNK_TOKENS:  # above the rule's cap (256 MiB of logits) < the rule (None) < below its floor
        logits = 4 * int(value) * vocab if value is not None else 0
        return (1,) if value is None else (0,) if logits > MAX_CHUNK_BYTES else \
            (2,) if logits < MIN_CHUNK_BYTES else (1,)
    if path == TILE_TOKENS:  # smaller tiles keep less: hidden_size (None) < hidden/4 < hidden/16
        return (0,) if value is None else ((2**16 // max(1, int(value))).bit_length() + 1,)
    return (0,) if value in (None, False) else (1,)


def turns_on(path: str, value: Any, depth: int) -> bool:
    """Whether ``value`` of ``path`` counts as one memory technique in the tie rule (LoRA vs full
    fine-tuning is not one; a size other than its default is, see :data:`SIZES`)."""
    if path == "adapter.method":
        return False
    if path == "distributed.sharding":
        return value != "none"
    return value is not None if path in SIZES else any(_rank(path, value, depth))


def _batches(cfg: RunConfig) -> list[tuple[int, int]]:
    """Valid (micro, accumulation) pairs, smallest micro first; the effective batch never changes."""
    t, procs = cfg.training, cfg.distributed.processes
    if t.micro_batch_size != "auto" and t.gradient_accumulation != "auto":
        batch: Batch = resolve_batch(t, procs)
        return [(batch.micro, batch.accumulation)]
    if t.micro_batch_size == "auto" or (t.micro_batch_size is None and t.effective_batch_size is not None):
        return valid_batches(t, procs)  # the same choices the probe step confirms among
    if t.effective_batch_size is None:
        return [(t.micro_batch_size or 8, 1)]
    per_process = t.effective_batch_size // procs
    return [(t.micro_batch_size, per_process // t.micro_batch_size)]


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return f"ratio {value['ratio']}"
    if value is None:
        return "null"  # as a recipe writes it
    return str(value).lower() if isinstance(value, bool) else str(value)
