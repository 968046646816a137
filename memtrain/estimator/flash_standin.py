"""FlashAttention in a trace: a stand-in that keeps what it keeps.

A run with ``model.attn_implementation: flash_attention_2`` (or 3, or a Hub flash kernel; what most
long-context fine-tunes of Gemma-2 use, whose transformers class has no SDPA) cannot be traced as
itself: the ``flash_attn`` package needs a CUDA GPU, and fake tensors run no kernel anyway. What
matters to memory is what the kernel keeps: FlashAttention keeps its inputs, its output and one
log-sum-exp per row and head for backward, never a tokens x tokens matrix, and takes no 4D mask
(padding and packing go through its variable-length path). PyTorch's SDPA flash kernel keeps the
same, so the estimator builds its fake model with :data:`STAND_IN`, an attention registered with
transformers' public ``AttentionInterface`` that calls transformers' own SDPA function without a
mask (causal where the module is) and without dropout (FlashAttention's dropout keeps no matrix,
SDPA's would take the math path), and a mask function that builds none. The
name avoids "flash": transformers treats any such name as a FlashAttention package to import.

Soft-capping (Gemma-2) and sliding windows change which scores count, not what is kept: the
stand-in leaves them out. The model's own code around the kernel (projections, rotary, the output
transpose) runs as in training.
"""

from __future__ import annotations

from typing import Any

STAND_IN = "memtrain_fa_standin"
_registered = False


def traced_attention(kernel: str | None) -> str | None:
    """The attention implementation a fake model of a run with ``kernel`` is built with."""
    from memtrain.model import is_flash

    if not is_flash(kernel):
        return kernel
    register()
    return STAND_IN


def register() -> None:
    """Register :data:`STAND_IN` with transformers (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(STAND_IN, _forward)
    AttentionMaskInterface.register(STAND_IN, _no_mask)
    _registered = True


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """FlashAttention's mask: none (transformers' own flash mask function returns the 2D padding mask
    where a row is padded, for the variable-length path, after reading the mask's values, which a
    fake tensor has not)."""
    return None


def _forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
             scaling: float | None = None, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=scaling)


def fake_model_kwargs(cfg: Any) -> dict[str, Any]:
    """:func:`memtrain.model.model_kwargs` of the ``model`` section ``cfg`` for a fake model: a
    FlashAttention asked for is :data:`STAND_IN`."""
    from memtrain.model import model_kwargs

    kwargs = model_kwargs(cfg)
    if "attn_implementation" in kwargs:
        kwargs["attn_implementation"] = traced_attention(kwargs["attn_implementation"])
    return kwargs
