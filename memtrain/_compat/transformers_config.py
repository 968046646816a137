"""transformers' model configs: the attention implementation a model was built with.

``PretrainedConfig._attn_implementation`` is the one place transformers keeps it (set by
``from_pretrained``/``from_config(attn_implementation=...)`` and ``set_attn_implementation``);
there is no public getter (``config.to_dict()`` leaves it out). The plugin reads it to plan the
user's attention kernel (:mod:`memtrain.plugin.options`). Checked on transformers 5.19–5.25.
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
