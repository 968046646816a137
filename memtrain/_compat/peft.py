"""peft: the parts of a LoRA layer memtrain's lean forward (:mod:`memtrain.patches.lora`) reads
beyond peft's public layer API.

Public first: memtrain builds adapters with ``LoraConfig`` / ``get_peft_model`` and reads a layer
through its public attributes (``lora_A``, ``lora_B``, ``lora_dropout``, ``scaling``,
``active_adapters``, ``disable_adapters``, ``merged``, ``base_layer``). peft has no public way to
compute a LoRA layer's forward in pieces, so the lean forward re-does ``Linear.forward`` for plain
adapters and must ask what peft's own forward asks first:

- ``_check_forward_args`` (private): peft's check of ``adapter_names`` and merged adapters;
- ``lora_variant`` (an internal dict, no underscore but undocumented): the adapters that are
  DoRA or another variant, which the lean forward leaves to peft.

Checked on peft 0.21.2 (installed); tested range :data:`memtrain._compat.versions.TESTED`
(0.20–0.21.2, issue 35's runs).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memtrain._compat.versions import private

_SHIM = "peft"


def check_forward_args(layer: Any, x: Any, *args: Any, **kwargs: Any) -> None:
    """peft's own argument check of a LoRA layer's forward (``LoraLayer._check_forward_args``)."""
    private(layer, "_check_forward_args", f"{_SHIM}.check_forward_args", "peft")(x, *args, **kwargs)


def has_variant(layer: Any, adapters: Any) -> bool:
    """Whether any of ``adapters`` is a LoRA variant (DoRA, ...) on ``layer`` (``lora_variant``)."""
    variants = private(layer, "lora_variant", f"{_SHIM}.has_variant", "peft")
    return any(a in variants for a in adapters)


@contextmanager
def quiet_renamed_checkpointing() -> Iterator[None]:
    """Inside: the FutureWarning transformers 5.24 gives when ``is_gradient_checkpointing`` (renamed
    ``is_activation_checkpointing``) is read is not shown. peft 0.21 reads the old name in
    ``get_peft_model`` and ``prepare_model_for_kbit_training``, so every LoRA run printed it; the
    property works as before, and memtrain checkpoints through its own patch."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield
