"""Fixes that name what the user meant: unknown keys, and sizes written without their unit.

An unknown key gets "did you mean" from, in order: the names other tools give the same setting
(:data:`ALIASES`: peft's ``lora_alpha``, transformers' ``num_train_epochs``, Axolotl's
``sequence_len``, ...), the key's initials (``lr`` -> ``learning_rate``), a close spelling
(:mod:`difflib`), or the section the key belongs to (``training.max_length`` -> ``data``). Each
suggestion is a field of the schema, so the fix it gives is one that loads.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from memtrain.config.base import Problem
from memtrain.units import format_bytes

# A name other tools (peft, transformers' TrainingArguments, TRL, Axolotl, LLaMA-Factory) use ->
# memtrain's field. Used only where that field is a key of the section at hand
# (tests/config/test_suggestions.py checks that each is a field of some section).
ALIASES: dict[str, str] = {
    # adapter
    "rank": "r", "lora_r": "r", "lora_rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "lora_target_modules": "target_modules", "lora_target": "target_modules",
    "target_module": "target_modules", "type": "method", "adapter": "method",
    # training
    "lr": "learning_rate", "batch_size": "micro_batch_size", "micro_batch": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size", "train_batch_size": "micro_batch_size",
    "global_batch_size": "effective_batch_size", "total_batch_size": "effective_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation", "grad_accum": "gradient_accumulation",
    "accumulation_steps": "gradient_accumulation", "num_epochs": "epochs",
    "num_train_epochs": "epochs", "epoch": "epochs", "warmup_steps": "warmup",
    "warmup_ratio": "warmup", "optim": "optimizer", "lr_scheduler_type": "lr_scheduler",
    "scheduler": "lr_scheduler", "max_norm": "max_grad_norm", "grad_clip": "max_grad_norm",
    "gradient_clipping": "max_grad_norm", "resume_from_checkpoint": "resume",
    "beta": "dpo_beta", "loss_type": "dpo_loss",
    # data
    "seq_len": "max_length", "sequence_len": "max_length", "sequence_length": "max_length",
    "max_seq_len": "max_length", "max_seq_length": "max_length", "seq_length": "max_length",
    "context_length": "max_length", "cutoff_len": "max_length", "max_len": "max_length",
    "dataset": "source", "path": "source", "data_files": "source", "sample_packing": "packing",
    "val_set_size": "eval_split", "test_size": "eval_split", "validation_split": "eval_split",
    "template": "chat_template",
    # model
    "model_name": "name", "model_name_or_path": "name", "base_model": "name",
    "torch_dtype": "dtype",
    # memory
    "gradient_checkpointing": "checkpointing", "activation_checkpointing": "checkpointing",
    "max_memory": "budget", "memory_budget": "budget", "gpu_memory": "budget",
    # output
    "output_dir": "dir", "overwrite_output_dir": "overwrite",
    # sections
    "lora": "adapter", "peft": "adapter", "train": "training", "trainer": "training",
}

# The recipe fields holding a size such as 24GiB (memory_section.MemoryConfig's size validator);
# tests/config/test_suggestions.py finds them independently and compares.
SIZE_FIELDS = ("memory.budget", "memory.host_budget", "memory.simulate_budget")


def did_you_mean(key: str, valid: list[str], sections: dict[str, type[BaseModel]],
                 section: str) -> str:
    """"did you mean `x`? " for an unknown ``key`` among ``valid``, or "" (``section``: the dotted
    path of the mapping it is in, "" at the top; ``sections``: the recipe's top-level sections)."""
    lowered = key.lower()
    alias = ALIASES.get(lowered)
    if alias in valid:
        return f"did you mean `{alias}`? "
    initials = [v for v in valid if "".join(w[0] for w in v.split("_")) == lowered]
    close = initials or difflib.get_close_matches(lowered, valid, n=1)
    if close:
        return f"did you mean `{close[0]}`? "
    for name, model in sections.items():  # a key of another section
        for candidate in (lowered, alias):
            if name != section and candidate in model.model_fields:
                return f"`{candidate}` is a key of `{name}`: move it there, as `{name}.{candidate}`. "
    return ""


def size_problem(path: str, value: Any) -> Problem | None:
    """A number where a size belongs (``memory.budget: 300``): the fix gives it a unit."""
    if path not in SIZE_FIELDS or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    key = path.rsplit(".", 1)[-1]
    number = f"{value:g}" if isinstance(value, float) else str(value)
    if value <= 0:
        fix = f"write a positive size with its unit, e.g. `{key}: 24GiB`."
    elif value >= 2**20:  # bytes, most likely
        size = format_bytes(value).replace(" ", "").replace(".00", "")
        fix = f"write it with its unit, `{key}: {size}` if {number} is bytes."
    else:
        fix = f"write it with its unit, `{key}: {number}MiB` or `{key}: {number}GiB` (a size needs one)."
    return Problem(path, value, "must look like '24GiB', '512MiB' or 'auto'", fix)
