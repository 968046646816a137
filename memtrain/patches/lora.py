"""LoRA adapters through peft; QLoRA when the base model is quantized.

Saves: the gradients and optimizer state of every frozen base weight (for AdamW, 12 of the 16
bytes per parameter of fp32 full fine-tuning). Costs: a little extra compute per adapted layer.
Follows Hu et al., 2021 (LoRA) and Dettmers et al., 2023 (QLoRA: 4-bit NF4 base, bf16 compute,
``prepare_model_for_kbit_training``); the implementation is peft's.
"""

from __future__ import annotations

from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from torch import nn

from memtrain.config import AdapterConfig, RunConfig
from memtrain.patches import ADAPTER, PatchRecord, add_records, register

Config = AdapterConfig

_TASKS = {"causal-lm": TaskType.CAUSAL_LM, "sequence-classification": TaskType.SEQ_CLS}


def is_quantized(model: nn.Module) -> bool:
    """True when the model's weights were loaded 4-bit or 8-bit by bitsandbytes."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def apply(model: nn.Module, cfg: AdapterConfig, task: str = "causal-lm") -> PeftModel:
    """Wrap ``model`` with LoRA adapters; only adapter (and head) parameters stay trainable.

    Args:
        model: a transformers model, possibly quantized by bitsandbytes (then this is QLoRA).
        cfg: rank, alpha, dropout and target modules.
        task: ``causal-lm`` or ``sequence-classification`` (the head is then trained in full).
    """
    if is_quantized(model):
        # Casts norms/embeddings to fp32 and makes inputs require grad, as QLoRA does; memtrain's
        # own checkpointing patch handles recompute, so peft's is left off.
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
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")
               and name.rsplit(".", 1)[-1] not in ("lora_A", "lora_B")]
    kind = "QLoRA" if is_quantized(model) else "LoRA"
    add_records(peft_model, [PatchRecord("lora", adapted, f"{kind} r={cfg.r} on {len(adapted)} layers")])
    return peft_model


@register("lora", ADAPTER)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if cfg.adapter.method != "lora":
        return None
    return apply(model, cfg.adapter, cfg.model.task)
