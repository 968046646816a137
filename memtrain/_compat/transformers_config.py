"""transformers' model configs: the attention implementation a model was built with.

``PretrainedConfig._attn_implementation`` is the one place transformers keeps it (set by
``from_pretrained``/``from_config(attn_implementation=...)`` and ``set_attn_implementation``);
there is no public getter (``config.to_dict()`` leaves it out). The plugin reads it to plan the
user's attention kernel (:mod:`memtrain.plugin.options`). Which kernel a model class runs when none
is asked for (SDPA where it supports it, else eager: Gemma-2's soft-capping has no SDPA) is the
class's ``_supports_sdpa`` (:func:`supports_sdpa`). Checked on transformers 5.19–5.25.
"""

from __future__ import annotations

from typing import Any

from memtrain._compat.versions import private


def attn_implementation(config: Any) -> str | None:
    """``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ... (None: not decided yet, or no config)."""
    if config is None:
        return None
    found = private(config, "_attn_implementation", "transformers_config.attn_implementation",
                    "transformers")
    return str(found) if found else None


def supports_sdpa(auto_class: Any, config: Any) -> bool | None:
    """Whether the model class ``auto_class`` builds for ``config`` runs PyTorch's SDPA
    (``PreTrainedModel._supports_sdpa``, found through the auto class's private ``_model_mapping``:
    transformers builds such a model with SDPA unless told otherwise, any other with eager attention,
    and refuses SDPA for it); None where the auto class has no model for the config."""
    return _supports(auto_class, config, "_supports_sdpa")


def supports_flash(auto_class: Any, config: Any) -> bool | None:
    """Whether that class takes FlashAttention (``_supports_flash_attn``); None as above."""
    return _supports(auto_class, config, "_supports_flash_attn")


def _supports(auto_class: Any, config: Any, flag: str) -> bool | None:
    mapping = private(auto_class, "_model_mapping", "transformers_config.supports", "transformers")
    try:
        cls = mapping[type(config)]
    except (KeyError, ValueError):
        return None
    return bool(getattr(cls, flag, False))
