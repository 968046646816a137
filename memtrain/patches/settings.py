"""Settings the planner chooses that patch no model: registered with the techniques, without a hook.

The optimizer, quantization, optimizer offload, the step in backward, DPO's
precomputed reference, sharding and the batch shape are carried out by the model loader, the
Trainer and FSDP2 (``model.py``, ``trainer/``, ``distributed/``), which stand after this package in
the run order; their planner facts live here so that the one registry (:mod:`memtrain.patches`)
holds every field the planner may decide, and the planner's space, the estimate's ``NEEDS_VALUE``
and the generated tables of techniques are derived from it. A patch's own fields are registered in
its module (``memory.tiled_mlp`` in :mod:`memtrain.patches.tiled_mlp`).
"""

from __future__ import annotations

from typing import Any

from memtrain.patches import CostInputs, Doc, Knob, ModelShape, fixed, one_process, register_setting


def _sharding_rank(value: Any, shape: ModelShape) -> tuple[int, ...]:
    # `grad_op` keeps at least what `full` keeps. Replicas are comparable with neither: with a
    # frozen base (LoRA) a process gathers the whole model under `grad_op`, more than one replica
    # holds, while full fine-tuning holds far more as replicas.
    return {"none": (0, 1), "grad_op": (1, 0), "full": (2, 0)}[value]


def _none(cfg: Any, shape: ModelShape) -> list[Any]:
    return []  # decided by auto-fit among the valid pairs (memtrain.plan.space.batches)


def _dequantization(inputs: CostInputs, value: Any) -> dict[str, float]:
    """The frozen weights' 4-bit dequantization on every pass (about 90% of a model's frozen
    parameters are in the quantized linears: the embeddings, norms and head are not)."""
    if value in ("none", "auto"):
        return {}
    return {"quantized_elements": int((inputs.parameters - inputs.trainable) * 0.9)}


def _optimizer_offloaded(inputs: CostInputs, value: Any) -> dict[str, float]:
    """The optimizer steps on the host: at the host's rates, gradients down and weights up."""
    return {"optimizer_offloaded": 1.0} if value else {}


# plugin=False: a user's model arrives loaded; the plugin describes its quantization, cannot change it
register_setting("quantization", "model.quantization", (
    Knob("model.quantization", fixed("none", "nf4"), "none", order=10, exact=False, base=True,
         cost=_dequantization),
), Doc("quantized base weights (bitsandbytes; QLoRA with LoRA)", "`model.quantization: nf4`",
       "frozen base weights to 4 (or 8) bits; dequantized per matmul", "[techniques](docs/techniques.md)"))

register_setting("optimizer", "training.optimizer", (
    # its cost: the optimizer's own rate per parameter, read by its name (costmodel.step_seconds)
    Knob("training.optimizer", fixed("adamw", "adamw_8bit"), "adamw", order=30, exact=False, plugin=True),
), Doc("8-bit / paged optimizers", "`training.optimizer: adamw_8bit`", "optimizer state to 8 bits",
       "[estimate.md](docs/bench/estimate.md)"))

register_setting("batch", "training.micro_batch_size", (
    Knob("training.micro_batch_size", _none, None, order=31, plannable=False, plugin=True, technique=False),
    Knob("training.gradient_accumulation", _none, None, order=32, plannable=False, plugin=True,
         technique=False),
))

# plugin=False: memtrain's Trainer builds the offloaded optimizer (trainer/build.py, create_optimizer);
# a user's Trainer builds its own from `optim`, which has no such choice
register_setting("optimizer_offload", "memory.offload.optimizer", (
    Knob("memory.offload.optimizer", one_process(False, True), False, order=60, cost=_optimizer_offloaded,
         to_host=True),
), Doc("optimizer offload", "`memory.offload.optimizer: true`",
       "optimizer state and step on the host; transfers each step (on a CPU-only machine the same RAM)",
       "[memory_modes.md](docs/bench/memory_modes.md)"))

# plugin=False: the step inside backward is memtrain's own training step (trainer/step.py), not the
# step a user's Trainer runs
register_setting("optimizer_in_backward", "training.optimizer_in_backward", (
    Knob("training.optimizer_in_backward", fixed(False, True), False, order=120),
), Doc("optimizer step inside backward", "`training.optimizer_in_backward: true`",
       "no full set of gradients; exact", "[floor.md](docs/bench/floor.md)"))

# plugin=False: memtrain's DPO builder precomputes the reference (trainer/build.py); a user's DPO
# trainer is configured by the user's own DPOConfig
register_setting("dpo_precompute_ref", "training.dpo_precompute_ref", (
    Knob("training.dpo_precompute_ref", fixed(False, True), False, order=160),
), Doc("DPO reference precomputed", "`training.dpo_precompute_ref: true`",
       "no reference forward in the step; one pass over the data first", "[dpo.md](docs/bench/dpo.md)"))

# one process: nothing to shard. plugin=False: a user's launcher (accelerate, torchrun) and
# TrainingArguments decide processes and FSDP; the plugin plans one process
register_setting("sharding", "distributed.sharding", (
    Knob("distributed.sharding",
         lambda cfg, shape: ["none", "grad_op", "full"] if cfg.distributed.processes > 1 else ["none"],
         "none", order=170, rank=_sharding_rank, needs_value=False),
), Doc("FSDP2 over processes and machines", "`distributed.processes: 2`, `distributed.nodes`",
       "each process holds its share", "[fsdp.md](docs/bench/fsdp.md), [multinode.md](docs/multinode.md)"))

register_setting("lean_kbit", "memory.lean_kbit", (), Doc(
    "lean k-bit loading", "`memory.lean_kbit: true` (default)", "no fp32 copies of embeddings, head, norms",
    "[floor.md](docs/bench/floor.md)"))
