"""What the estimator traces for a recipe (``TraceSetup``): its architecture config, step shape, device.

:func:`resolve_config` finds a model's architecture without weights or network (the recipe's
``from_config``, a local folder, the built-in catalog, or the local Hugging Face cache);
:func:`_plan` checks that every field the estimate depends on has a value and notes what the
estimate assumes. Used by :mod:`memtrain.estimator.estimate` and the planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from memtrain import patches
from memtrain.config import ModelConfig, RunConfig, load_recipe
from memtrain.config.batch import resolve_batch
from memtrain.data.rows import Rows, worst_case
from memtrain.device import cuda_available, device_type
from memtrain.errors import MemtrainError
from memtrain.estimator import catalog
from memtrain.estimator.layers import Pattern, layer_pattern


@dataclass
class TraceSetup:
    """What to trace: the recipe, its architecture, the step shape and the target device."""

    cfg: RunConfig
    config: PretrainedConfig
    label: str
    depth: int
    micro_batch: int
    seq_len: int
    device: str
    trace_device: str
    notes: list[str]
    rows: Rows  # the longest batch: from the data, or the recipe's worst case (padding per micro-batch)
    pattern: Pattern  # which layers are alike (what the short traces hold)


# the fields an estimate needs decided: every registered knob that says so, in the planner's order
NEEDS_VALUE = tuple(k.path for k in patches.knobs() if k.needs_value)


def trace_setup(recipe: RunConfig | str | Path | dict, overrides: Sequence[str],
                device: str | None, rows: Rows | None = None) -> TraceSetup:
    """What to trace for ``recipe``; ``rows`` is the data's longest batch (default: the recipe's
    worst case, every row ``data.max_length`` tokens)."""
    cfg = recipe if isinstance(recipe, RunConfig) else load_recipe(recipe, overrides)
    if isinstance(recipe, RunConfig) and overrides:
        raise ValueError("pass overrides with a recipe file or dict, not with a RunConfig")
    check_decided(cfg, length=rows is None)
    target = device or device_type()
    if target not in ("cuda", "cpu"):
        raise MemtrainError(f"`--device` must be `cuda` or `cpu`, got {target!r}.")
    config, label = resolve_config(cfg.model)
    batch = resolve_batch(cfg.training, cfg.distributed.processes)
    rows = rows or worst_case(cfg)
    seq_len = rows.longest
    check_positions(config, seq_len)
    trace_device = "cuda" if target == "cuda" and cuda_available() else "cpu"
    notes = [rows.describe(batch.micro)]
    if cfg.model.task == "sequence-classification" and cfg.model.num_labels is None:
        notes.append("classification head sized for 2 labels (model.num_labels unset, data not read)")
    if target == "cuda" and trace_device == "cpu":
        notes.append("CUDA run traced on CPU fake tensors, with CUDA's multi-tensor optimizer kernels; "
                     "int8 layers follow their CPU path")
    from memtrain.model import attention

    kernel = attention(cfg.model, config)  # the recipe's, else the model's default (eager for Gemma-2)
    note = attention_note(kernel, config, target, trace_device, rows.packed or rows.padded(batch.micro))
    if kernel == "eager" and not cfg.model.attn_implementation:
        name = type(config).__name__.removesuffix("Config")
        note += f"; the model's default: transformers has no SDPA for {name}"
    notes.append(note)
    notes += _process_notes(cfg)
    if target == "cuda" and trace_device == "cpu" and cfg.memory.offload.optimizer is True:
        notes.append("optimizer offload traced with synchronous copies (its CPU mode): the state and "
                     "the host copies of parameters and gradients are counted as host memory")
    if target == "cuda" and trace_device == "cpu" and cfg.memory.offload.parameters:
        notes.append("parameter offload copies nothing on a CPU trace: the shards, their gradients and "
                     "optimizer state are counted on the device (an upper bound for the GPU)")
    if target == "cuda" and cfg.training.optimizer == "paged_adamw_8bit":
        notes.append("paged optimizer state counted as device memory (all pages resident)")
    depth = int(config.num_hidden_layers)
    return TraceSetup(cfg, config, label, depth, batch.micro, seq_len, target, trace_device, notes, rows,
                      layer_pattern(cfg, config, depth))


def check_decided(cfg: RunConfig, allow: Sequence[str] = (), length: bool = True) -> None:
    """Every field an estimate depends on has a value (``allow``: fields the caller settles itself;
    ``length``: ``data.max_length`` too, unless the data's rows give the length).

    Raises:
        MemtrainError: the first such field that is ``auto``, with the fix.
    """
    needs = (*NEEDS_VALUE, "distributed.sharding") if cfg.distributed.processes > 1 else NEEDS_VALUE
    for path in needs:
        if path not in allow and recipe_value(cfg, path) == "auto":
            raise MemtrainError(f"`{path}` is `auto`: the planner chooses it, and an estimate needs a "
                                f"value. Fix: set `{path}` (e.g. `{path}=...` on the command line) or "
                                "run `memtrain plan`.")
    if cfg.data.max_length == "auto" and length:
        raise MemtrainError("`data.max_length` is `auto`: the planner finds the longest length that fits "
                            "the budget, and an estimate needs a length. Fix: run `memtrain plan` (it "
                            "reports the length as `data.max_length`), or set `data.max_length` (e.g. "
                            "`data.max_length=4096`).")


DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def attention_note(kernel: str, config: PretrainedConfig, target: str, trace_device: str,
                   masked: bool) -> str:
    """Which attention kernel the trace ran (``kernel``: :func:`memtrain.model.attention`) and
    whether it holds a tokens x tokens matrix.

    PyTorch's ``scaled_dot_product_attention`` picks a kernel per call: on a CPU (torch 2.x) its
    flash kernel for any mask, but the math path (an s x s matrix per head, kept for backward)
    when attention dropout is on; on CUDA flash (no mask) or memory-efficient (a mask; dropout
    too), neither with an s x s matrix.
    """
    from memtrain.model import is_flash

    if kernel == "eager":
        return "attention: eager, an s x s matrix of scores per head kept for backward (quadratic in length)"
    if is_flash(kernel):
        return (f"attention: {kernel}, traced as a stand-in on SDPA's flash kernel without a mask or dropout "
                "(memtrain/estimator/flash_standin.py): no s x s matrix, its output and log-sum-exp kept for "
                "backward, what FlashAttention keeps; padding and packing take its variable-length path, "
                "no 4D mask")
    mask = "; the 4D attention mask (padded or packed batch) is s x s itself" if masked else ""
    if trace_device == "cuda":
        return f"attention: SDPA as this GPU's kernel choice (traced on fake CUDA tensors){mask}"
    dropout = next((float(getattr(config, k)) for k in DROPOUT_KEYS if getattr(config, k, None)), 0.0)
    if dropout > 0:
        bound = ("; CUDA's flash and memory-efficient kernels keep no such matrix, so at long lengths "
                 "this CUDA estimate is an upper bound") if target == "cuda" else ""
        return (f"attention: SDPA with dropout {dropout:g} takes PyTorch's math path on a CPU, an s x s "
                f"matrix per head kept for backward (quadratic in the length){bound}{mask}")
    held = ("what CUDA's flash (no mask) and memory-efficient (masked) kernels keep" if target == "cuda"
            else "what this CPU runs")
    return (f"attention: SDPA traced as PyTorch's CPU flash kernel: no s x s matrix, its output and "
            f"log-sum-exp kept for backward, {held}{mask}")


def _process_notes(cfg: RunConfig) -> list[str]:
    """What the figures of one of several processes include."""
    n, how = cfg.distributed.processes, cfg.distributed.sharding
    if n == 1:
        return []
    if how == "none":
        return [f"one of {n} DDP replicas: the whole model, plus DDP's gradient buckets (a second "
                "copy of the trained gradients, counted as `gradients`)"]
    kept = "kept from each layer's forward to its backward" if how == "grad_op" else "resharded after forward"
    return [f"one of {n} FSDP2 processes (sharding {how}), traced in a fake process group: parameters, "
            f"gradients and optimizer state sharded; gathered layers ({kept}) as `unsharded`"]


def recipe_value(cfg: RunConfig, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


def resolve_config(cfg: ModelConfig) -> tuple[PretrainedConfig, str]:
    """The architecture config of the recipe's model and a label for it, without weights or network.

    ``model.from_config`` and local folders are read as training reads them; hub ids come from
    the built-in catalog (:mod:`memtrain.estimator.catalog`) or else the local Hugging Face cache.
    """
    from memtrain import sources
    from memtrain.model import apply_config_overrides, build_config

    num_labels = cfg.num_labels if cfg.task == "sequence-classification" else None
    if cfg.from_config is not None:
        config, label = build_config(cfg, num_labels), f"from_config ({cfg.from_config['model_type']})"
    elif cfg.name.startswith(sources.PKG_PREFIX) or sources.looks_local(cfg.name):  # type: ignore[union-attr]
        config, label = build_config(cfg, num_labels), cfg.name
    elif (found := catalog.lookup(cfg.name)) is not None:  # type: ignore[arg-type]
        label, values = found
        config = apply_config_overrides(AutoConfig.for_model(values.pop("model_type"), **values), cfg)
    else:
        config, label = apply_config_overrides(_cached_config(cfg), cfg), cfg.name
    if num_labels is not None:
        config.num_labels = num_labels
    if cfg.task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        # Training takes it from the tokenizer; any id gives the same memory.
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = (eos[0] if isinstance(eos, list) else eos) or 0
    return config, label  # type: ignore[return-value]


def _cached_config(cfg: ModelConfig) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(cfg.name, revision=cfg.revision, local_files_only=True,
                                          trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        raise ConfigNotFound(
            f"`model.name`: {cfg.name!r} is not in memtrain's catalog and its config is not in the local "
            "Hugging Face cache (the estimator never uses the network). Fix: use a catalog model ("
            f"{', '.join(catalog.names())}), point `model.name` at a local folder with its config.json, or "
            "give the architecture in `model.from_config`."
        ) from None


LEARNED_TABLES = ("bert", "roberta", "xlm-roberta", "camembert")  # the last three: a padding offset


def position_limit(config: PretrainedConfig) -> int | None:
    """The most tokens in one sequence this model takes (None: its config states no limit).

    The one place this is decided (the estimator, ``data.max_length: auto``, ``validate``, training
    and the plugin all ask here). Learned position tables end where they end: GPT-2's
    ``n_positions``; BERT's ``max_position_embeddings``, RoBERTa's less its padding offset. Any
    other model with ``max_position_embeddings`` (the RoPE families: Llama, Mistral, Qwen, Gemma,
    ...) was trained up to it; RoPE scaling with a ``factor`` and ``original_max_position_embeddings``
    (``rope_scaling``/``rope_parameters``, e.g. YaRN) stretches the positions to ``factor`` x
    ``original``, and the limit is the larger of the two (not Llama 3's own ``llama3`` scaling, which
    stretches the low frequencies only: Llama-3.2-1B says 131,072, not 32 x 8,192).
    ``model.config_overrides`` raises it.
    """
    limit = getattr(config, "n_positions", None)
    if limit is not None:
        return int(limit)
    table = getattr(config, "max_position_embeddings", None)
    if table is None:
        return None
    if config.model_type in LEARNED_TABLES[1:]:
        return int(table) - ((config.pad_token_id or 0) + 1)
    return max(int(table), _scaled_positions(config))


def _scaled_positions(config: PretrainedConfig) -> int:
    """``factor`` x ``original_max_position_embeddings`` of the RoPE scaling (0: none stated)."""
    found = (getattr(config, k, None) for k in ("rope_parameters", "rope_scaling"))
    rope: dict[str, Any] = next((v for v in found if isinstance(v, dict)), {})
    kinds = [p for p in rope.values() if isinstance(p, dict)] or [rope]  # per layer type (Gemma 3)
    most = 0
    for params in kinds:
        if params.get("rope_type", params.get("type")) == "llama3":
            continue  # stretches low frequencies only; Meta's configs state the length it reached
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if isinstance(factor, int | float) and original:
            most = max(most, int(factor * original))
    return most


def check_max_length(cfg: RunConfig) -> None:
    """A number in ``data.max_length`` within the model's positions (:func:`position_limit`).

    Quiet when the architecture cannot be found without the network (a hub id neither in the
    catalog nor in the local cache): training checks the loaded model's config instead.

    Raises:
        MemtrainError: ``data.max_length`` is longer than the model's positions.
    """
    if not isinstance(cfg.data.max_length, int):
        return
    try:
        config, _ = resolve_config(cfg.model)
    except ConfigNotFound:
        return
    check_positions(config, cfg.data.max_length)


class ConfigNotFound(MemtrainError):
    """A hub id whose config is neither in the catalog nor in the local Hugging Face cache."""


def check_positions(config: PretrainedConfig, seq_len: int) -> None:
    """A model cannot take more tokens than its positions (fake tensors would, silently)."""
    limit = position_limit(config)
    if limit is None or seq_len <= limit:
        return
    learned = getattr(config, "n_positions", None) is not None or config.model_type in LEARNED_TABLES
    extend = ("" if learned else " or extend the model's context in `model.config_overrides` (e.g. "
              f"`{{rope_scaling: {{rope_type: yarn, factor: {-(-seq_len // limit)}, "
              f"original_max_position_embeddings: {limit}}}}}`)")
    raise MemtrainError(
        f"`data.max_length`: {seq_len:,} tokens exceed the {limit:,} positions this model "
        f"({config.model_type}) has. Fix: set `data.max_length` to {limit} or less{extend}.")
