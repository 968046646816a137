"""Activation checkpointing: keep each layer's input, recompute its activations in backward.

Saves: the activations inside every checkpointed layer (about all but one hidden state per
layer). Costs: one more forward pass of the checkpointed layers during backward. Uses the
non-reentrant ``torch.utils.checkpoint`` through transformers' ``gradient_checkpointing_enable``.
"""

from __future__ import annotations

from torch import nn

from memtrain.config import RunConfig
from memtrain.patches import CHECKPOINTING, PatchRecord, add_records, register

Mode = str | int


def apply(model: nn.Module, mode: Mode = "full") -> nn.Module:
    """Enable activation checkpointing on every layer of a transformers model."""
    if mode != "full":
        raise ValueError(f"unsupported checkpointing mode {mode!r}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()
    layers = [n for n, m in base.named_modules() if getattr(m, "gradient_checkpointing", False)]
    add_records(model, [PatchRecord("checkpointing", layers, "full activation checkpointing",
                                    undo=base.gradient_checkpointing_disable)])
    return model


@register("checkpointing", CHECKPOINTING)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if cfg.memory.checkpointing in ("none", "auto"):
        return None
    return apply(model, cfg.memory.checkpointing)
