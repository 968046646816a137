"""Recipe checks that involve several fields, kept apart from the schema's field definitions.

Each returns the :class:`Problem` list for what it checks (see :mod:`memtrain.config.base`: one
pass reports every mistake); :mod:`memtrain.config.schema` calls them from its ``after``
validators with its sections (typed ``Any`` here: importing the schema would be a cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memtrain.config.base import MISSING, Problem
from memtrain.config.grpo_section import grpo_problems


def in_backward_problems(sections: Mapping[str, Any]) -> list[Problem]:
    """The optimizer step inside backward updates each parameter as soon as its gradient is
    complete: there is no moment when all gradients exist to be accumulated, clipped or scaled."""
    t, model, memory = sections["training"], sections.get("model"), sections.get("memory")
    distributed = sections.get("distributed")
    if t.optimizer_in_backward is not True:
        return []
    fix = "set `training.optimizer_in_backward: false`"
    out = []
    if t.max_grad_norm is not None:
        out.append(Problem(
            "training.optimizer_in_backward", True, "cannot clip by the global norm "
            f"(`training.max_grad_norm: {t.max_grad_norm}`): each parameter steps before the others "
            "have gradients", f"set `training.max_grad_norm: null`, or {fix}."))
    accum = t.gradient_accumulation
    procs = distributed.processes if distributed is not None else 1
    implied = (t.effective_batch_size // (t.micro_batch_size * procs)
               if isinstance(t.micro_batch_size, int) and t.effective_batch_size else None)
    if (isinstance(accum, int) and accum > 1) or (implied or 1) > 1:
        shown = accum if isinstance(accum, int) else implied
        out.append(Problem(
            "training.optimizer_in_backward", True, "cannot accumulate gradients "
            f"(`training.gradient_accumulation` = {shown}): the step happens in every backward",
            "make micro_batch_size × processes equal the effective batch size "
            f"(`training.gradient_accumulation: 1`), or {fix}."))
    if model is not None and model.dtype == "fp16":
        out.append(Problem("training.optimizer_in_backward", True, "does not work with fp16 loss "
                           "scaling (`model.dtype: fp16`)", f"use bf16 or fp32, or {fix}."))
    if memory is not None and memory.offload.optimizer is True:
        out.append(Problem("training.optimizer_in_backward", True, "and `memory.offload.optimizer` "
                           "both move the optimizer step", f"choose one: {fix}, or turn the offload off."))
    if procs > 1:
        out.append(Problem("training.optimizer_in_backward", True, f"is single-process "
                           f"(`distributed.processes: {procs}`)", f"{fix}."))
    return out


def batch_problems(t: Any, procs: int) -> list[Problem]:
    """effective = micro × accumulation × processes must hold exactly when all are given."""
    eff, micro, accum = t.effective_batch_size, t.micro_batch_size, t.gradient_accumulation
    fixed_micro = micro if isinstance(micro, int) else None
    fixed_accum = accum if isinstance(accum, int) else None
    if eff is None:
        return []
    if eff % procs:
        return [Problem(
            "training.effective_batch_size", eff, f"is not a multiple of processes = {procs}",
            "choose an effective batch size divisible by `distributed.processes`.",
        )]
    if fixed_micro and fixed_accum and fixed_micro * fixed_accum * procs != eff:
        return [Problem(
            "training.effective_batch_size", eff,
            f"does not equal micro_batch_size × gradient_accumulation × processes = "
            f"{fixed_micro} × {fixed_accum} × {procs} = {fixed_micro * fixed_accum * procs}",
            "drop one of the three so memtrain derives it, or make them agree.",
        )]
    if fixed_micro and eff % (fixed_micro * procs):
        return [Problem(
            "training.effective_batch_size", eff,
            f"is not a multiple of micro_batch_size × processes = {fixed_micro * procs}",
            "choose an effective batch size divisible by it, or another micro_batch_size.",
        )]
    if fixed_accum and eff % (fixed_accum * procs):
        return [Problem(
            "training.effective_batch_size", eff,
            f"is not a multiple of gradient_accumulation × processes = {fixed_accum * procs}",
            "choose an effective batch size divisible by it, or another gradient_accumulation.",
        )]
    return []




def node_problems(d: Any) -> list[Problem]:
    """The fields several machines need, and numbers that must agree with `nodes`."""
    out = []
    if isinstance(d.master_port, int) and not 0 < d.master_port < 65536:
        out.append(Problem("distributed.master_port", d.master_port, "is not a TCP port",
                           "choose a free port from 1 to 65535 (29500 is torchrun's default; below 1024 "
                           "needs root)."))
    if isinstance(d.node_rank, int) and not 0 <= d.node_rank < d.nodes:
        out.append(Problem(
            "distributed.node_rank", d.node_rank, f"must be between 0 and `distributed.nodes` - 1 = "
            f"{d.nodes - 1}", "number the machines 0 (the one at `master_addr`) to nodes - 1, or set "
            "`env` to read NODE_RANK / SLURM_NODEID."))
    if d.nodes == 1:
        return out
    if d.processes % d.nodes:
        out.append(Problem(
            "distributed.processes", d.processes, f"counts the processes of all {d.nodes} machines "
            "(`distributed.nodes`) and must be a multiple of it", f"set it to {d.nodes} × the "
            f"processes per machine, e.g. {d.nodes * max(1, d.processes // d.nodes)}."))
    if d.node_rank is None:
        out.append(Problem(
            "distributed.node_rank", MISSING, f"is needed with `distributed.nodes: {d.nodes}`",
            "set this machine's number (0 on the machine at `master_addr`), or `env` to read "
            "NODE_RANK / SLURM_NODEID from the launcher."))
    if d.master_addr is None:
        out.append(Problem(
            "distributed.master_addr", MISSING, f"is needed with `distributed.nodes: {d.nodes}`",
            "set the host name or IP address of machine 0, or `env` to read MASTER_ADDR."))
    return out


def objective_problems(sections: Mapping[str, Any]) -> list[Problem]:
    """``training.objective: dpo`` trains on preference pairs, one process, through TRL's log-prob head."""
    t, data, model = sections.get("training"), sections.get("data"), sections.get("model")
    memory, distributed = sections.get("memory"), sections.get("distributed")
    if t is None or data is None:
        return []
    out = []
    preference = data.kind == "preference"
    if t.objective == "sft" and preference:
        out.append(Problem("data.format", "preference", "pairs are trained by preference optimisation, "
                           "not by `training.objective: sft`", "set `training.objective: dpo`, or use a "
                           "supervised format (completion, messages, ...)."))
    if t.objective != "dpo":
        return out + grpo_problems(sections)
    if not preference:
        out.append(Problem("training.objective", "dpo", f"needs preference pairs, and `data.format` is "
                           f"`{data.format}`", "set `data.format: preference` (prompt, chosen and rejected "
                           "columns; see docs/DATA.md)."))
    if model is not None and model.task != "causal-lm":
        out.append(Problem("training.objective", "dpo", f"trains a causal LM, not `{model.task}`",
                           "set `model.task: causal-lm`."))
    adapter = sections.get("adapter")
    if adapter is not None and adapter.method == "full":
        out.append(Problem("adapter.method", "full", "DPO needs a reference model; memtrain's is the base "
                           "model with the LoRA adapter disabled (full fine-tuning would need a second, "
                           "frozen copy of the model, which memtrain does not build or plan yet)",
                           "set `adapter.method: lora` (or `auto`)."))
    if memory is not None and memory.loss == "chunked":
        out.append(Problem("memory.loss", "chunked", "does not apply to DPO: TRL's DPOTrainer computes the "
                           "log-probabilities in tiles itself, without the full logits",
                           "set `memory.loss: standard` (or leave it out)."))
    if distributed is not None and distributed.processes > 1:
        out.append(Problem("training.objective", "dpo", f"runs in one process "
                           f"(`distributed.processes: {distributed.processes}`)",
                           "set `distributed.processes: 1`."))
    return out
