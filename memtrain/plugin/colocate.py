"""TRL's GRPO with vLLM colocated: ``prepare_for_budget`` plans vLLM's share of the GPU in bytes.

A ``GRPOConfig(use_vllm=True, vllm_mode="colocate")`` has vLLM generate in the training process,
holding ``vllm_gpu_memory_utilization`` of the GPU (TRL's default 0.3 is a guess).
:func:`colocated_vllm` computes the share the generation batch needs
(:func:`memtrain.estimator.vllm_colocate.colocate_share`: vLLM's weights, the KV cache of every
completion generated at once at full length, its allowances), which ``prepare_for_budget`` sets, with
``vllm_max_model_length`` where it was unset (vLLM would otherwise size its one-request check for the
model's whole context); the training step is planned into what the share leaves of the budget.

vLLM is built inside ``GRPOTrainer(...)``, before ``attach``: when ``attach`` re-plans for the
Trainer's data it keeps the utilization the Trainer was built with and plans training beside it.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from memtrain import patches
from memtrain.estimator.vllm_colocate import ColocateShare, colocate_share


def is_colocated(args: Any) -> bool:
    """A TRL ``GRPOConfig`` whose completions vLLM generates in this process."""
    return (hasattr(args, "num_generations") and bool(getattr(args, "use_vllm", False))
            and getattr(args, "vllm_mode", None) == "colocate")


def vllm_weights(model: nn.Module) -> tuple[int, int]:
    """The base model's weights as vLLM loads them (adapter weights left out: TRL merges them before
    each weight sync): the count in the model's dtype, and the count in bitsandbytes 4-bit (packed
    values counted unpacked)."""
    plain = quantized = 0
    for name, param in model.named_parameters():
        if "lora_" in name or "modules_to_save" in name:
            continue
        state = getattr(param, "quant_state", None)
        if state is not None and getattr(state, "shape", None) is not None:
            quantized += math.prod(state.shape)
        else:
            plain += param.numel()
    return plain, quantized


def device_total(budget: int) -> int:
    """The GPU's whole memory (vLLM's utilization is a fraction of it); on a machine without CUDA
    (planning for a GPU elsewhere, tests) the budget stands for the device."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return budget


def colocated_vllm(model: nn.Module, args: Any, budget: int, length: int, *,
                   built: bool = False) -> ColocateShare | None:
    """vLLM's share for ``args`` (None unless vLLM is colocated): the smallest utilization whose KV
    cache holds the generation batch (``generation_batch_size`` completions per process, vLLM's
    ``max_num_seqs``) at ``vllm_max_model_length`` tokens, or at ``length`` where that is unset;
    ``built``: vLLM was built already (``attach``), its utilization is the one in ``args``."""
    if not is_colocated(args):
        return None
    inner = patches.base_model(model)
    config = inner.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    parameters, quantized = vllm_weights(inner)
    tp = max(1, int(getattr(args, "vllm_tensor_parallel_size", 1) or 1))
    sequences = max(1, args.generation_batch_size // max(1, args.world_size)) * tp
    stated = getattr(args, "vllm_max_model_length", None)
    return colocate_share(text, total=device_total(budget), parameters=parameters, sequences=sequences,
                          length=stated or length, dtype=getattr(config, "dtype", None) or getattr(
                              config, "torch_dtype", None), quantized=quantized, tensor_parallel=tp,
                          sleep=bool(getattr(args, "vllm_enable_sleep_mode", False)),
                          utilization=args.vllm_gpu_memory_utilization if built else None)
