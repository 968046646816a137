"""Load the tokenizer and model a recipe names: dtype, bitsandbytes quantization, task head.

Models come from a hub id, a local folder, a ``pkg:`` folder inside an installed package, or are
built from a config dict (``model.from_config``) with random weights for offline work. A model
built from a config and quantized is first saved to a temporary folder and reloaded through
``from_pretrained``, since bitsandbytes quantizes at load time.
"""

from __future__ import annotations

import difflib
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from memtrain import sources
from memtrain.config import ModelConfig, Problem, RecipeError
from memtrain.errors import MemtrainError, first_line

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_AUTO_CLASSES = {
    "causal-lm": AutoModelForCausalLM,
    "sequence-classification": AutoModelForSequenceClassification,
}
# The names of a sequence classifier's head (BERT/RoBERTa/DistilBERT `classifier`, decoder models'
# `score`; matched as a name suffix, so DistilBERT's `pre_classifier` too). The head is new and
# trained in full (peft's `modules_to_save`), so bitsandbytes must leave it unquantized.
CLASSIFIER_HEADS = ("classifier", "score")


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The recipe's tokenizer, with a padding token (the end-of-sequence token when it has none)."""
    location = cfg.tokenizer or cfg.name
    assert location is not None  # guaranteed by the schema
    tokenizer = _from_pretrained(AutoTokenizer, "model.tokenizer" if cfg.tokenizer else "model.name",
                                 location, cfg, {})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def build_config(cfg: ModelConfig, num_labels: int | None = None) -> PretrainedConfig:
    """The model's architecture config, without weights (used by training and the estimator)."""
    if cfg.from_config is not None:
        values = dict(cfg.from_config)
        model_type = values.pop("model_type")
        if model_type not in CONFIG_MAPPING:  # transformers' own error lists every type it knows
            close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise RecipeError([Problem("model.from_config.model_type", model_type,
                                       "not a model type this transformers knows",
                                       f"{hint}Use the `model_type` of the model's config.json "
                                       "(`llama`, `qwen2`, `gpt2`, ...).")]) from None
        try:
            config = AutoConfig.for_model(model_type, **values)
        except (ValueError, TypeError, StrictDataclassError) as err:  # the last: sizes that don't divide
            raise RecipeError([Problem("model.from_config", cfg.from_config,
                                       f"cannot build a config ({err})",
                                       "use a `model_type` transformers knows and its config keys.")]
                              ) from None
        vocab, pad = getattr(config, "vocab_size", None), getattr(config, "pad_token_id", None)
        if isinstance(vocab, int) and isinstance(pad, int) and not 0 <= pad < vocab:  # the embedding's
            # padding row: torch refuses to build it (an assertion deep in the model's constructor)
            whose = "" if "pad_token_id" in values else f"{model_type}'s default pad token id "
            raise RecipeError([Problem("model.from_config.pad_token_id", pad,
                                       f"{whose}is outside the vocabulary of {vocab:,} tokens "
                                       "(`vocab_size`): the embedding has no such row to keep for padding",
                                       f"set `model.from_config.pad_token_id` to an id below {vocab} (e.g. "
                                       "0, or the tokenizer's pad token id), or raise `vocab_size`.")])
    else:
        assert cfg.name is not None
        config = _from_pretrained(AutoConfig, "model.name", cfg.name, cfg, {})
    if num_labels is not None:
        config.num_labels = num_labels
    return apply_config_overrides(config, cfg)


ROPE_KEYS = ("rope_parameters", "rope_scaling")  # transformers 5's name first, then the older one
_ROPE_KEPT = ("rope_theta", "partial_rotary_factor")  # what a new `rope_type` keeps of the old settings


def apply_config_overrides(config: PretrainedConfig, cfg: ModelConfig) -> PretrainedConfig:
    """Set ``model.config_overrides`` on ``config`` (in place; returned for chaining).

    Both real loads and the estimator's fake build pass through here. A RoPE dict
    (``rope_scaling`` or ``rope_parameters``) is merged into the model's own RoPE settings, so
    ``rope_theta`` and the like survive; with a new ``rope_type`` only ``rope_theta`` (and a partial
    rotary factor) are kept. Per-layer-type RoPE settings (Gemma 3) get the dict in each layer type.

    Raises:
        RecipeError: a key the model's config does not have (a misspelt key would change nothing).
    """
    for key, value in (cfg.config_overrides or {}).items():
        if key in ROPE_KEYS and isinstance(value, dict):
            attr = next((k for k in ROPE_KEYS if hasattr(config, k)), key)
            setattr(config, attr, _merge_rope(getattr(config, attr, None) or {}, value))
        elif hasattr(config, key):
            setattr(config, key, value)
        else:
            import difflib

            known = sorted(k for k in config.to_dict() if not k.startswith("_"))
            near = difflib.get_close_matches(key, known, n=3)
            raise RecipeError([Problem(
                f"model.config_overrides.{key}", value,
                f"is not a setting of this model's config ({config.model_type})",
                (f"did you mean {' or '.join(f'`{n}`' for n in near)}? " if near else "")
                + f"Its settings include: {', '.join(known[:12])}, ...")])
    return config


def _merge_rope(current: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    if current and all(isinstance(v, dict) for v in current.values()):  # per layer type
        nested = all(isinstance(v, dict) for v in change.values())
        return {kind: _merge_rope(params, change.get(kind, {}) if nested else change)
                for kind, params in current.items()}
    if "rope_type" in change and change["rope_type"] != current.get("rope_type"):
        current = {k: v for k, v in current.items() if k in _ROPE_KEPT}
    return {**current, **change}


def model_class(cfg: ModelConfig) -> Any:
    """The transformers auto class for the recipe's task (causal LM or sequence classification)."""
    return _AUTO_CLASSES[cfg.task]


def is_flash(kernel: str | None) -> bool:
    """Whether the attention implementation ``kernel`` is a FlashAttention (``flash_attention_2``, a Hub
    flash kernel): transformers' own test, "flash" in its name."""
    return kernel is not None and "flash" in kernel


def attention(cfg: ModelConfig, config: PretrainedConfig) -> str:
    """The attention kernel a model of ``config`` built from the recipe runs: ``model.attn_implementation``,
    else the config's own, else transformers' default for the model class (SDPA where the class
    supports it, eager attention otherwise: Gemma-2). Raises :class:`RecipeError` naming
    ``model.attn_implementation`` where the recipe asks for SDPA and the model has none (transformers'
    own error names no field)."""
    from memtrain._compat.transformers_config import attn_implementation, supports_flash, supports_sdpa

    asked = cfg.attn_implementation or attn_implementation(config)
    auto = model_class(cfg)
    sdpa = supports_sdpa(auto, config)
    name = type(config).__name__.removesuffix("Config")
    if asked == "sdpa" and sdpa is False:
        raise RecipeError([Problem(
            "model.attn_implementation", "sdpa", f"{name} models have no SDPA attention in transformers",
            "set `model.attn_implementation: eager` or leave it unset (the model's default, eager).")])
    if is_flash(asked) and supports_flash(auto, config) is False:
        raise RecipeError([Problem(
            "model.attn_implementation", asked, f"{name} models take no FlashAttention in transformers",
            f"set `model.attn_implementation` to {'sdpa' if sdpa else 'eager'} or leave it unset.")])
    return asked or ("eager" if sdpa is False else "sdpa")


def model_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Keyword arguments every model build shares: weight dtype and attention kernel.

    The estimator builds its fake model with the same arguments, so both cannot drift apart.
    """
    kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.dtype]}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    return kwargs


# Every `from_pretrained` of a model: the layers as the model defines them. From transformers 5.25
# `use_kernels` defaults to on, which swaps layers for kernels fetched from the Hugging Face Hub on
# CUDA: offline it raises ("Version 2 of 'kernels-community/rotary' is not available in the local
# cache", the H200 session of 2026-12-04), and online the swapped layers are not the ones memtrain's
# estimate traces and its patches replace. 5.19-5.24 default to off; every version takes the keyword.
PRETRAINED_KWARGS: dict[str, Any] = {"use_kernels": False}


def quantization_config(cfg: ModelConfig,
                        quant_storage: torch.dtype | None = None) -> BitsAndBytesConfig | None:
    """bitsandbytes settings for ``model.quantization`` (None when not quantized).

    ``quant_storage``: the dtype packed 4-bit weights are stored as (default uint8; FSDP wants
    the dtype of the other weights, see :func:`memtrain.distributed.sharding.quant_storage`).
    """
    if cfg.quantization in ("none", "auto"):
        return None
    # transformers leaves the last module unquantized by the name of the model's last parameter,
    # which for a classifier is `classifier.bias`, a name that matches no module: its head would be
    # quantized, and a 4-bit head can neither train in full nor run on a CPU after peft copies it
    skip = list(CLASSIFIER_HEADS) if cfg.task == "sequence-classification" else None
    if cfg.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    compute = DTYPES[cfg.compute_dtype or cfg.dtype]
    return BitsAndBytesConfig(
        load_in_4bit=True,
        llm_int8_skip_modules=skip,
        bnb_4bit_quant_type=cfg.quantization,
        bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=quant_storage or torch.uint8,
    )


def load_model(
    cfg: ModelConfig,
    num_labels: int | None = None,
    pad_token_id: int | None = None,
    seed: int = 0,
    quant_storage: torch.dtype | None = None,
) -> PreTrainedModel:
    """Load (or build) the model with the recipe's dtype, quantization and task head.

    Args:
        cfg: the ``model`` section.
        num_labels: classes for sequence classification.
        pad_token_id: the tokenizer's padding id (classification heads need it to find the last
            token of padded rows).
        seed: seeds the random initialisation of models built from a config and of new heads.
        quant_storage: storage dtype of 4-bit weights (see :func:`quantization_config`).
    """
    torch.manual_seed(seed)
    config = build_config(cfg, num_labels if cfg.task == "sequence-classification" else None)
    if pad_token_id is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad_token_id
    auto = model_class(cfg)
    attention(cfg, config)  # SDPA asked of a model without it: the recipe's field, before any download
    quant = quantization_config(cfg, quant_storage)
    with _flash_errors(cfg):
        model = _load(cfg, config, auto, quant)
    if quant is not None:
        keep_4bit_trainable_on_cpu(model)
    return model


@contextmanager
def _flash_errors(cfg: ModelConfig) -> Iterator[None]:
    """transformers' error for a FlashAttention it cannot load (no ``flash_attn`` package, no CUDA, no
    Hub kernel offline), as the recipe field's."""
    try:
        yield
    except (ImportError, ValueError, RuntimeError) as err:
        kernel = cfg.attn_implementation
        if not is_flash(kernel) or "flash" not in str(err).lower():
            raise
        raise RecipeError([Problem(
            "model.attn_implementation", kernel, f"transformers cannot run it here ({first_line(err)[:200]})",
            "install the flash-attn package on a CUDA GPU (pip install flash-attn --no-build-isolation), "
            "or set `model.attn_implementation: sdpa` (eager where the model has no SDPA); estimates and "
            "plans need neither.")]) from None


def _load(cfg: ModelConfig, config: PretrainedConfig, auto: Any, quant: BitsAndBytesConfig | None) -> Any:
    """The model of ``config`` as the recipe builds or loads it (quantized where ``quant`` says)."""
    kwargs = model_kwargs(cfg)
    if cfg.from_config is not None and quant is None:
        return auto.from_config(config, **kwargs)
    if quant is not None:
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = _device_map()
    if cfg.from_config is not None:  # quantize a config-built model: save, then load quantized
        with tempfile.TemporaryDirectory(prefix="memtrain-model-") as tmp:
            auto.from_config(config, dtype=kwargs["dtype"]).save_pretrained(tmp)
            model = auto.from_pretrained(tmp, config=config, **kwargs, **PRETRAINED_KWARGS)
        from memtrain._compat.transformers_model import set_name_or_path

        model.name_or_path = f"from_config:{config.model_type}"
        set_name_or_path(model.config, model.name_or_path)
    else:
        assert cfg.name is not None
        model = _from_pretrained(auto, "model.name", cfg.name, cfg,
                                 {"config": config, **kwargs, **PRETRAINED_KWARGS})
    return model


def keep_4bit_trainable_on_cpu(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    After a no-grad forward in eval mode, ``bnb.nn.Linear4bit`` on CPU repacks its weight into a
    layout for fast bf16 inference, after which LoRA gradients silently become None. Turning the
    repack off on every 4-bit layer keeps training correct; it changes nothing on CUDA.

    Returns:
        The number of 4-bit layers changed.
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def _device_map() -> dict[str, Any]:
    """Quantized weights are created on their final device (:func:`memtrain.device.compute_device`)."""
    from memtrain.device import compute_device

    device = compute_device()
    return {"": device.index if device.type == "cuda" else "cpu"}


def _from_pretrained(factory: Any, field: str, location: str, cfg: ModelConfig,
                     kwargs: dict[str, Any]) -> Any:
    """``factory.from_pretrained`` with recipe-level errors instead of tracebacks."""
    try:
        path = sources.resolve(location)
    except FileNotFoundError as err:
        raise RecipeError([Problem(field, location, f"cannot be found ({err})",
                                   "check the path or install the package that ships it.")]) from None
    if Path(path).is_dir() and not any(Path(path).iterdir()):
        raise RecipeError([Problem(field, location, "is an empty folder",
                                   "point it at a folder with config.json and the weights (or the "
                                   "tokenizer files), or at a hub id.")])
    try:
        return factory.from_pretrained(path, revision=cfg.revision,
                                       trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError, SafetensorError, StrictDataclassError) as err:
        # OSError: missing files or network; ValueError/KeyError: an unknown `model_type` or a
        # config without one; SafetensorError: truncated or damaged weights
        if is_flash(cfg.attn_implementation) and "flash" in str(err).lower():
            raise  # the FlashAttention kernel, not the model: named by load_model
        first = first_line(err)
        raise MemtrainError(
            f"`{field}`: could not load {location!r}: {first}\n"
            "Fix: check the name, that the folder holds a complete model (config.json with a "
            "`model_type` transformers knows, weights that are not truncated), your network or "
            "HF_HUB_OFFLINE, and access rights (gated models need `huggingface-cli login`)."
        ) from None


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; 4-bit packed weights count as their logical size."""
    total = trainable = 0
    for param in model.parameters():
        n = param.numel()
        if hasattr(param, "quant_state") or type(param).__name__ == "Params4bit":
            n *= 2 * param.element_size()  # two 4-bit values per stored byte
        total += n
        if param.requires_grad:
            trainable += n
    return total, trainable
