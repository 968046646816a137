"""transformers' models: process-wide patches while the estimator builds and traces a model on fake
tensors, and private attributes of models and configs.

Checked on transformers 5.24 and 5.25 (installed); tested range :data:`memtrain._compat.versions.TESTED`
(5.19–5.25: issue 35's runs, 5.25 on 2026-12-03).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from memtrain._compat.torch_tools import FakeTensor


def no_split_modules(model: Any) -> set[str]:
    """The class names of a transformers model's repeated blocks (``PreTrainedModel._no_split_modules``,
    which accelerate's ``device_map`` reads too; transformers has no public accessor)."""
    return set(getattr(model, "_no_split_modules", None) or ())


def own_checkpointing_on(model: Any) -> bool:
    """Whether transformers' own activation checkpointing is on for ``model`` (False for a model
    that is not a transformers one). transformers 5.24 renamed ``is_gradient_checkpointing`` to
    ``is_activation_checkpointing``, the old name kept as an alias that warns (FutureWarning,
    "removed in v6"); 5.19-5.23 have only the old name."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if isinstance(getattr(type(model), name, None), property):
            return bool(getattr(model, name))
    return False


def disable_own_checkpointing(model: Any) -> None:
    """Turn transformers' own activation checkpointing off (``activation_checkpointing_disable``
    from 5.24; ``gradient_checkpointing_disable`` before, an alias that warns since)."""
    off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    off()


def set_name_or_path(config: Any, name: str) -> None:
    """Set a config's ``_name_or_path`` (what ``model.name_or_path`` reads and ``save_pretrained``
    writes); transformers sets it only from ``from_pretrained``, with no public setter."""
    config._name_or_path = name


@contextmanager
def unpacked_positions() -> Iterator[None]:
    """Inside: transformers' masks never read packed sequences from position ids (a fake batch's
    values mean nothing, and the traced batches are not packed). Patches
    ``transformers.masking_utils.find_packed_sequence_indices`` process-wide while inside:
    transformers has no switch for it."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextmanager
def unpadded_masks() -> Iterator[None]:
    """transformers' "can the SDPA mask be skipped?" checks see no padding mask for a fake one: the
    traced batch has none, so the real check (``padding_mask.all()``) would say the same. Patches
    ``masking_utils._ignore_causal_mask_sdpa`` and ``_ignore_bidirectional_mask_sdpa`` (private)
    process-wide while inside: no public switch."""
    from transformers import masking_utils

    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    originals = {name: getattr(masking_utils, name) for name in names}

    def without_fake_mask(check: Callable[..., bool]) -> Callable[..., bool]:
        def wrapped(padding_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> bool:
            return check(None if isinstance(padding_mask, FakeTensor) else padding_mask, *args, **kwargs)

        return wrapped

    for name, check in originals.items():
        setattr(masking_utils, name, without_fake_mask(check))
    try:
        yield
    finally:
        for name, check in originals.items():
            setattr(masking_utils, name, check)


@contextmanager
def uninitialized_values() -> Iterator[None]:
    """Build a transformers model without initializing its weights' values (for fake weights).

    Values mean nothing on fake tensors, and some initializers ask them questions that fake
    tensors cannot answer (``trunc_normal_`` resamples until no value lies outside its bounds:
    ModernBERT). ``initialize_weights`` only sets values; ``init_weights`` still ties the
    embeddings, as transformers does itself when it builds a model on the meta device.
    Patches ``PreTrainedModel.initialize_weights`` process-wide while inside: ``from_config`` has
    no switch to skip value initialization (``_fast_init`` is gone in transformers 5).
    """
    from transformers import PreTrainedModel

    original = PreTrainedModel.initialize_weights
    PreTrainedModel.initialize_weights = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        PreTrainedModel.initialize_weights = original  # type: ignore[method-assign]


