"""LoRA adapters through peft; QLoRA when the base model is quantized.

Saves: the gradients and optimizer state of every frozen base weight (for AdamW, 12 of the 16
bytes per parameter of fp32 full fine-tuning). Costs: a little extra compute per adapted layer.
Follows Hu et al., 2021 (LoRA) and Dettmers et al., 2023 (QLoRA: 4-bit NF4 base, bf16 compute);
the implementation is peft's. On a quantized base the frozen weights stay in their loaded dtype
(``memory.lean_kbit``, as torchtune and Unsloth do) unless the recipe asks for peft's fp32 upcast.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from torch import nn

from memtrain.config import AdapterConfig, RunConfig
from memtrain.patches import ADAPTER, PatchRecord, add_records, register

Config = AdapterConfig

_TASKS = {"causal-lm": TaskType.CAUSAL_LM, "sequence-classification": TaskType.SEQ_CLS}


def is_quantized(model: nn.Module) -> bool:
    """True when the model's weights were loaded 4-bit or 8-bit by bitsandbytes."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def apply(model: nn.Module, cfg: AdapterConfig, task: str = "causal-lm", lean_kbit: bool = True) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; only adapter (and head) parameters stay trainable.

    Args:
        model: a transformers model, possibly quantized by bitsandbytes (then this is QLoRA).
        cfg: rank, alpha, dropout and target modules.
        task: ``causal-lm`` or ``sequence-classification`` (the head is then trained in full).
        lean_kbit: on a quantized base, leave the frozen embeddings, head and norms in their
            loaded dtype (see :func:`prepare_lean`) instead of peft's fp32 upcast.
    """
    quantized = is_quantized(model)
    if quantized and not lean_kbit:
        # peft's QLoRA preparation: every non-quantized weight (norms, embeddings, the output
        # head) cast to fp32; memtrain's own checkpointing patch handles recompute, so peft's is off.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        modules_to_save=cfg.modules_to_save,
        task_type=_TASKS[task],
    )
    peft_model = get_peft_model(model, lora)
    if quantized and lean_kbit:
        prepare_lean(peft_model)
    keep_input_dtype(peft_model)
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")
               and name.rsplit(".", 1)[-1] not in ("lora_A", "lora_B")]
    kind = "QLoRA" if quantized else "LoRA"
    lean = " (frozen weights kept in their dtype)" if quantized and lean_kbit else ""
    detail = f"{kind} r={cfg.r} on {len(adapted)} layers{lean}"
    add_records(peft_model, [PatchRecord("lora", adapted, detail)])
    return peft_model


def prepare_lean(model: nn.Module) -> int:
    """QLoRA without upcasting frozen weights: only what trains is made fp32.

    peft's ``prepare_model_for_kbit_training`` casts every bf16/fp16 weight that is not 4-bit to
    fp32: the embeddings and output head (2 GiB more on Llama-3.1-8B) and the norms, whose fp32
    weights also turn the hidden states after each norm into fp32. Nothing needs it for numerical
    reasons: transformers' RMSNorm/LayerNorm already compute their statistics in fp32 and cast back
    (as in plain bf16 training), and the loss upcasts logits to fp32. What does need fp32 is what
    the optimizer updates: LoRA weights (peft already keeps them fp32) and modules trained in full
    (``modules_to_save``, a classifier's head), cast here. tests/test_lean_kbit.py compares loss
    curves with peft's path.

    Returns:
        The number of trainable tensors cast to fp32.
    """
    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
            cast += 1
    return cast


class _CastLinear(torch.autograd.Function):
    """``F.linear(x.to(weight.dtype), weight)`` that keeps ``x`` for backward in its own dtype.

    peft casts a LoRA layer's bf16 input to the adapter's fp32 before ``lora_A``, and that linear
    then keeps the fp32 copy for its weight gradient: twice the bytes of the input, which the
    frozen base layer already keeps in bf16. Here the cast happens again in backward instead, so
    the saved tensor is the input itself. The values are the same as peft's: casting bf16 to fp32
    is exact, and the same fp32 matmuls run.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = (grad @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            flat_grad = grad.reshape(-1, grad.shape[-1])
            grad_w = flat_grad.t() @ x.reshape(-1, x.shape[-1]).to(weight.dtype)
        return grad_x, grad_w


def _cast_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _CastLinear.apply(x, self.weight)


def keep_input_dtype(model: nn.Module) -> int:
    """Make every plain LoRA layer keep its input for backward in the input's dtype (see
    :class:`_CastLinear`): exact, and costs one cast of the input in backward.

    Layers with a variant (DoRA), a bias on ``lora_A`` or inputs already in the adapter's dtype
    are left to peft. Returns the number of layers changed.
    """
    changed = 0
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or getattr(module, "lora_variant", None):
            continue
        if not hasattr(module, "cast_input_dtype_enabled"):
            continue
        linears = [m for m in lora_a.values() if type(m) is nn.Linear and m.bias is None]
        if len(linears) != len(lora_a):
            continue
        module.cast_input_dtype_enabled = False  # peft's switch: lora_A receives the input as is
        for linear in linears:
            linear.forward = types.MethodType(_cast_linear_forward, linear)
        changed += 1
    return changed


@register("lora", ADAPTER)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if cfg.adapter.method != "lora":
        return None
    return apply(model, cfg.adapter, cfg.model.task, cfg.memory.lean_kbit)
