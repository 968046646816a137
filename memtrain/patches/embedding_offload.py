"""Embedding offload: the frozen input embedding table stays in host memory.

Saves: the input embedding table on the device, vocabulary × hidden values (Llama-3.1-8B in bf16:
128,256 × 4,096 × 2 bytes = 1.0 GiB, a fifth of its 4-bit QLoRA weights). LoRA and QLoRA never
train it, and a lookup reads only the rows of the batch's tokens.

Costs: host RAM for the table (counted against ``memory.host_budget``); per forward, the token ids
go to the host (8 bytes a token; on CUDA this waits for the ids), the rows are gathered there
(batch × tokens × hidden, briefly in host memory) and copied to the device. Backward has nothing
to do for a frozen table. The step computes exactly what it computed before: the rows are the
same values, so the loss and every gradient are unchanged.

On CPU, device and host are the same RAM: the table stays where it is, the meter files it as host
memory, and the looked-up rows are copied once (the "device" copy), so that an estimate traced on
a CPU counts what a GPU holds and the effect is testable. On CUDA the table is pinned (copies
from it are DMA-ready) and ``model.to(...)`` leaves it on the host (the module's ``_apply`` is
replaced), so the Trainer's own placement cannot undo the patch.

Follows the idea of ZeRO-Offload/Infinity's parameter offload (Ren et al., 2021; Rajbhandari et
al., 2021), narrowed to the one layer whose forward is a gather: only the rows used cross to the
device. Written here because accelerate's CPU offload (``cpu_offload``, ``AlignDevicesHook``)
copies the whole weight to the device for every forward, which would keep the table on the device
at the step's start and move 1 GiB a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain._compat.torch_tools import is_fake, keep_on_device
from memtrain.config import RunConfig, decided
from memtrain.device import keep_on_host, kept_on_host
from memtrain.errors import MemtrainError
from memtrain.memory.meter import mark_host
from memtrain.patches import (
    OFFLOAD,
    CostInputs,
    Doc,
    Knob,
    NoMatchError,
    PatchRecord,
    add_records,
    one_process,
    register,
    undo_records,
)
from memtrain.patches.checkpointing import wrap_forward
from memtrain.units import format_bytes

NAME = "embedding_offload"
FIELD = "memory.offload.embeddings"


@dataclass(frozen=True)
class Config:
    """Settings of the embedding offload (only whether it is on)."""

    enabled: bool = True


def input_embedding(model: nn.Module) -> nn.Embedding:
    """The model's frozen, untied input embedding table.

    Raises:
        NoMatchError: the model has none, or it is trained, or the output head shares its weight
            (the head needs it on the device); the message says which.
    """
    getter = getattr(model, "get_input_embeddings", None)
    table = getter() if callable(getter) else None
    if not isinstance(table, nn.Embedding):
        raise NoMatchError(f"`{FIELD}`: this model has no input embedding table (an nn.Embedding "
                           f"behind get_input_embeddings(); found {type(table).__name__}). Fix: set "
                           f"`{FIELD}: false`.")
    if table.weight.requires_grad:
        raise NoMatchError(f"`{FIELD}`: the input embedding is trained (full fine-tuning, or listed "
                           "in the adapter's modules to save), and a trained table must stay on the "
                           f"device. Fix: set `{FIELD}: false`, or train an adapter (LoRA, QLoRA).")
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is not None and getattr(head, "weight", None) is table.weight:
        raise NoMatchError(f"`{FIELD}`: the output head shares the input embedding's weight "
                           "(tie_word_embeddings), so the table is needed on the device anyway. "
                           f"Fix: set `{FIELD}: false`.")
    return table


def _host_lookup(forward: Callable[..., torch.Tensor], table: nn.Embedding) -> Callable[..., torch.Tensor]:
    """``forward`` run on the host, its output copied to the device the token ids came from."""

    @functools.wraps(forward)
    def run(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        host = table.weight.device
        rows = forward(input_ids.to(host), *args, **kwargs)  # the gather, in host memory
        mark_host(rows)
        # On CPU `to` would return the rows themselves; a copy stands for the device's own.
        return rows.to(input_ids.device, copy=True)

    return run


def apply(model: nn.Module, cfg: Config | None = None) -> nn.Module:
    """Keep ``model``'s frozen input embedding table in host memory (see the module docstring).

    Args:
        model: a transformers model (possibly peft-wrapped) whose input embedding is frozen.
        cfg: :class:`Config`; ``enabled=False`` leaves the model as it is.

    Returns:
        The same model, patched in place; :func:`undo` brings the table back to the device.

    Raises:
        NoMatchError: no frozen, untied input embedding (:func:`input_embedding`).
        MemtrainError: already applied.
    """
    if cfg is not None and not cfg.enabled:
        return model
    table = input_embedding(model)
    weight = table.weight
    if kept_on_host(weight):
        raise MemtrainError(f"`{FIELD}`: this model's embedding is already offloaded. Fix: apply it "
                            "once (call `undo` first).")
    device = weight.device
    if device.type != "cpu":  # a GPU: move the table to (pinned) host memory
        moved = weight.data.to("cpu")
        weight.data = moved if is_fake(moved) else moved.pin_memory()
    keep_on_host(weight)
    undo_forward = wrap_forward(table, lambda forward: _host_lookup(forward, table))
    keep_on_device(table)  # model.to() skips it

    def undo() -> None:
        undo_forward()
        table.__dict__.pop("_apply", None)
        keep_on_host(weight, False)
        if device.type != "cpu":
            weight.data = weight.data.to(device)

    name = next((n for n, m in model.named_modules() if m is table), "input embedding")
    size = format_bytes(weight.numel() * weight.element_size())
    detail = f"embedding offload: {name} ({size}) kept in host memory, looked-up rows copied to the device"
    add_records(model, [PatchRecord(NAME, [name], detail, undo=undo)])
    return model


def undo(model: nn.Module) -> nn.Module:
    """Bring the offloaded embedding table back to its device."""
    return undo_records(model, NAME)


# the frozen input table on the host (one process: FSDP2 shards it instead); the looked-up rows
# cross to the device once per micro-batch. The plugin may choose it: `model.to()` (the Trainer's
# placement) leaves the table on the host.
def _cost(inputs: CostInputs, value: Any) -> dict[str, float]:
    """The looked-up rows: gathered on the host, copied to the device, once per micro-batch."""
    return {"embedding_bytes": inputs.tokens * inputs.shape.hidden * inputs.element} if value else {}


KNOBS = (Knob(FIELD, one_process(False, True), False, order=70, plugin=True, patches_model=True,
              cost=_cost, to_host=True, slower_when_leaner=True),)
DOC = Doc("embedding offload", f"`{FIELD}: true`",
          "the frozen input embedding table in host memory; its looked-up rows cross each micro-batch",
          "[embedding_offload.md](docs/bench/embedding_offload.md)")


@register(NAME, OFFLOAD, FIELD, config=Config, apply=apply, knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if decided(cfg.memory.offload.embeddings, FIELD, "true or false") is not True:
        return None
    if cfg.distributed.processes > 1:
        raise MemtrainError(f"`{FIELD}`: with several processes FSDP2 shards every weight of the model on "
                            "the devices, and a table in host memory cannot be sharded. Fix: set "
                            f"`{FIELD}: false` (sharding already splits the table across processes).")
    return apply(model, Config())
