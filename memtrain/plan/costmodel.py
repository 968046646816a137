"""Predict the seconds of one optimizer step from what the estimator's trace says it computes.

The planner needs to rank settings by speed before running any of them. A fake-tensor trace of a
step (:mod:`memtrain.estimator.trace`) already knows everything the step does: its matmul and
attention FLOPs (recompute included, counted by torch's ``FlopCounterMode``), the number of ops it
dispatches, the bytes its tensors write, the bytes offload moves to the host, the parameters the
optimizer updates. This model turns those counts into seconds with per-machine rates::

    step = accumulation × micro + optimizer
    micro = FLOPs / matmul rate + bytes written / memory bandwidth + ops × per-op cost
            + quantized weights × passes / dequantize rate + 2 × offloaded bytes / host bandwidth
    optimizer = trainable parameters × seconds per parameter (per optimizer)
                + optimizer ops × per-op cost (+ gradients down and weights up when offloaded)

The rates come from ``memtrain calibrate`` (:mod:`memtrain.estimator.calibrate`), measured on the
machine that trains. Without a profile, CPU rates are measured once (about 10 s) and saved; a
CUDA run planned on a machine without CUDA uses the nominal rates below, named in the plan.
No library predicts step time from a trace, so this is hand-written; ``scripts/bench/planner/planner.py``
checks it against measured steps.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from memtrain.device import cuda_available
from memtrain.errors import MemtrainError
from memtrain.estimator import calibrate
from memtrain.estimator.trace import Pass, Work

# A mid-range data-centre GPU (A100-class) at typical, not peak, efficiency: a fallback for
# planning a CUDA run where no GPU can be measured. `memtrain calibrate` on the GPU replaces it.
NOMINAL_CUDA_RATES: dict[str, Any] = {
    "matmul_flops": {"fp32": 15e12, "bf16": 150e12, "fp16": 150e12},
    "memory_bandwidth": 1.2e12,
    "host_to_device_bandwidth": 20e9,
    "device_to_host_bandwidth": 20e9,
    "op_seconds": 8e-6,
    "optimizer_seconds_per_parameter": {"adamw": 1.5e-11, "adamw_8bit": 1.5e-11,
                                        "paged_adamw_8bit": 1.6e-11, "adafactor": 2e-11, "sgd": 5e-12},
    "dequantize_nf4_elements": 2e11,
}
# rates a CPU profile may lack: the copy bandwidths fall back to the memory bandwidth (Rates.host_bandwidth)
OPTIONAL_RATES = ("host_to_device_bandwidth", "device_to_host_bandwidth")


@dataclass(frozen=True)
class Rates:
    """How fast one device does each kind of work."""

    source: str
    values: dict[str, Any]

    def matmul(self, dtype: str) -> float:
        table = self.values["matmul_flops"]
        return float(table.get(dtype) or table.get("bf16") or table["fp32"])

    def optimizer(self, name: str) -> float:
        table = self.values["optimizer_seconds_per_parameter"]
        return float(table.get(name) or table.get(name.removeprefix("paged_")) or max(table.values()))

    @property
    def host_bandwidth(self) -> float:
        """Host<->device copy bandwidth (on a CPU-only machine: a memory copy)."""
        return float(self.values.get("host_to_device_bandwidth") or self.values["memory_bandwidth"])


@functools.cache
def rates(device: str) -> Rates:
    """This machine's rates for ``device`` (``cpu`` or ``cuda``): calibrated, measured now, or nominal."""
    path = calibrate.profile_path()
    profile = calibrate.load_profile(path) or {}
    saved = (profile.get("rates") or {}).get(device)
    threads = torch.get_num_threads() if device == "cpu" else None  # CPU rates depend on them
    if saved and saved.get("version") == calibrate.RATES_VERSION and saved.get("threads") == threads \
            and _complete(saved):
        return Rates(f"measured by `memtrain calibrate` ({path})", saved)
    if device == "cuda" and not cuda_available():
        return Rates("nominal A100-class rates (no GPU here to measure; run `memtrain calibrate` "
                     "on the training machine)", NOMINAL_CUDA_RATES)
    measured = calibrate.measure_rates(device, quick=True)
    profile.setdefault("version", 1)
    profile.setdefault("rates", {})[device] = measured
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=2), encoding="utf-8")
        where = f"measured now (quick) and saved to {path}"
    except OSError:
        where = "measured now (quick; the profile could not be saved)"
    return Rates(where, measured)


def _complete(saved: dict[str, Any]) -> bool:
    """Every rate the cost model reads is in ``saved``, a positive number (or, for a table, an
    object of them): else (a hand-edited or truncated profile) the rates are measured again."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and v > 0

    for key in (k for k in NOMINAL_CUDA_RATES if k not in OPTIONAL_RATES):
        value = saved.get(key)
        table = isinstance(NOMINAL_CUDA_RATES[key], dict)
        if not (isinstance(value, dict) and value and all(number(v) for v in value.values())
                if table else number(value)):
            return False
    return True


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one optimizer step, and of its parts."""

    seconds: float
    parts: dict[str, float]


def step_seconds(work: Work, *, micro_batches: int, rates: Rates, dtype: str, optimizer: str,
                 trainable: int, quantized_elements: int = 0, recompute_passes: float = 0.0,
                 offloaded_bytes: int = 0, optimizer_offloaded: bool = False,
                 optimizer_rates: Rates | None = None, parameter_bytes: int = 4,
                 embedding_bytes: int = 0, extra_dequantized: int = 0) -> StepCost:
    """Seconds of an optimizer step of ``micro_batches`` micro-batches like the traced ones.

    Args:
        work: the traced step's counts (its forward/backward figures cover ``work.micro_batches``).
        micro_batches: gradient accumulation of the planned step.
        rates: the training device's rates.
        dtype: compute dtype (``fp32``, ``bf16``, ``fp16``).
        optimizer: the recipe's optimizer name.
        trainable: trainable parameters (what the optimizer updates).
        quantized_elements: weight elements stored in 4 bits (dequantized on every pass).
        recompute_passes: extra forward passes over the weights from checkpointing (0 to 1).
        offloaded_bytes: activation bytes moved to the host per micro-batch (they come back too).
        optimizer_offloaded: the optimizer steps on the host (``memory.offload.optimizer``).
        optimizer_rates: the host's rates when the optimizer is offloaded (default: ``rates``).
        parameter_bytes: bytes per trainable parameter (gradients down, weights up when offloaded).
        embedding_bytes: rows looked up in a host embedding table per micro-batch
            (``memory.offload.embeddings``): gathered on the host, then copied to the device (both
            counted at the host-device copy rate).
        extra_dequantized: 4-bit weight elements dequantized beyond one per pass (the tiled MLP
            dequantizes its weights once per tile and pass).
    """
    per = 1.0 / max(1, work.micro_batches)
    compute = work.flops * per / rates.matmul(dtype)
    memory = work.written * per / float(rates.values["memory_bandwidth"])
    launches = work.ops * per * float(rates.values["op_seconds"])
    dequant_rate = rates.values.get("dequantize_nf4_elements") or 0
    dequant = 0.0
    if quantized_elements and dequant_rate:  # every forward and backward pass dequantizes each weight
        dequant = (quantized_elements * (2 + recompute_passes) + extra_dequantized) / dequant_rate
    offload = 2 * offloaded_bytes / rates.host_bandwidth
    offload += 2 * embedding_bytes / rates.host_bandwidth  # the host gather and the copy, at copy speed
    opt_rates = optimizer_rates or rates
    opt = (trainable * opt_rates.optimizer(optimizer)
           + work.optimizer_ops * float(opt_rates.values["op_seconds"]))
    transfer = 2 * trainable * parameter_bytes / rates.host_bandwidth if optimizer_offloaded else 0.0
    parts = {"matmul": compute, "memory": memory, "launch": launches, "dequantize": dequant,
             "offload": offload}
    parts = {k: v * micro_batches for k, v in parts.items()}
    parts["optimizer"] = opt + transfer
    return StepCost(sum(parts.values()), parts)


def work_at(w2: Work | None, w3: Work | None, micro: int) -> Work:
    """Work of one micro-batch of ``micro`` examples (plus one optimizer step), from traces at
    micro-batch 2 and 3: FLOPs and bytes are linear in the batch, op counts do not depend on it."""
    if w2 is None or w3 is None:
        raise MemtrainError("the estimate did not record the step's work (FLOPs); cannot plan")
    f2, f3 = w2.flops / w2.micro_batches, w3.flops / w3.micro_batches
    b2, b3 = w2.written / w2.micro_batches, w3.written / w3.micro_batches

    def part(p2: Pass, p3: Pass) -> Pass:
        a, b = p2.scaled(1 / w2.micro_batches), p3.scaled(1 / w3.micro_batches)
        return Pass(max(0.0, a.flops + (micro - 2) * (b.flops - a.flops)), a.ops,
                    max(0, round(a.written + (micro - 2) * (b.written - a.written))))

    return Work(1, max(0.0, f2 + (micro - 2) * (f3 - f2)), round(w2.ops / w2.micro_batches),
                max(0, round(b2 + (micro - 2) * (b3 - b2))), w2.optimizer_ops,
                part(w2.recomputed, w3.recomputed), part(w2.recomputed_selective, w3.recomputed_selective))
