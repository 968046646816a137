"""``memtrain calibrate``: measure this machine's memory overheads and speed, save them as a profile.

What a GPU holds beyond live tensors is not visible to a trace, so the estimator reports it as
named lines (:func:`overheads`), with documented defaults until this machine is measured:

- ``cuda_context``: the CUDA context with its kernel images and library handles, taken before
  the first tensor. Default 764 MiB: what every training row of the first GPU session held
  outside the allocator (NVML used less max reserved, 18 rows from a 19M to a 1.24B Llama, full,
  LoRA and QLoRA; H100 80GB, driver 580, CUDA 13.0, torch 2.11; docs/bench/gpu.md). Before that
  GPU measurement the default was 1 GiB, after the Transformers guide "Model training anatomy"
  (1.3 GB of CUDA kernels before lazy module loading). Other GPUs and drivers differ: calibrate.
  Measured here as the device memory the process uses after CUDA initialisation and a few
  training steps, minus what PyTorch's allocator reserved (read with ``nvidia-smi`` before and
  after): a step loads kernels (attention, loss, optimizer) that one matmul does not, 83 MiB of
  them on an H100 (every training row there held 764 MiB outside the allocator).
- ``cuda_workspaces``: what cuBLAS keeps allocated in the caching allocator once matmuls ran, a
  workspace per thread that runs them (the main thread; autograd's backward thread). Default
  64 MiB (2 x 32 MiB, torch's Hopper default; an H100 showed 64-66 MiB above the traced tensors on
  every row of docs/bench/gpu.md); measured here as the bytes still allocated after one matmul's
  forward and backward once the tensors are gone.
- ``fragmentation``: memory the caching allocator reserves but does not hand out, as a fraction
  of the bytes a step allocates and frees (its peak minus the tensors that live across steps:
  weights, buffers, optimizer state). Default with expandable segments 10% (an assumption until a
  GPU measures it); with PyTorch's default allocator settings 24%, the median of the first GPU
  session's 14 rows (8% to 59%: one fraction does not predict that allocator well). Measured
  here as ``(max_memory_reserved - max_memory_allocated) / (max_memory_allocated - resident)``
  over a few real training steps after the first, under the allocator settings memtrain's runs
  use (:mod:`memtrain.allocator`: expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` is set);
  a profile measured under other settings is not used for it.

The planner also needs speed rates, which :func:`calibrate` measures on the CPU and, when there
is one, the GPU: matmul FLOP/s per dtype, memory bandwidth, host<->device copy bandwidth.
The profile is JSON at ``$MEMTRAIN_CALIBRATION`` or ``~/.cache/memtrain/calibration.json``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memtrain import allocator
from memtrain._compat.torch_tools import clear_cublas_workspaces
from memtrain.device import configure_allocator, cuda_available, synchronize

log = logging.getLogger(__name__)

ENV_VAR = "MEMTRAIN_CALIBRATION"
DEFAULT_CUDA_CONTEXT = 764 * 2**20
DEFAULT_FRAGMENTATION = 0.10  # expandable segments (memtrain's allocator settings): an assumption
DEFAULT_FRAGMENTATION_CACHING = 0.24  # PyTorch's default settings: an H100's median (docs/bench/gpu.md)
DEFAULT_CUDA_WORKSPACES = 64 * 2**20
# Rates saved with an older version are measured again: version 1 divided the optimizer's step time
# by a quarter of the parameters it updated (4x too slow per parameter).
RATES_VERSION = 2
_CONTEXT_DEFAULT_SOURCE = ("default 764 MiB, measured outside the allocator on every training row of an "
                           "H100 80GB (CUDA 13.0, torch 2.11; docs/bench/gpu.md); run `memtrain calibrate` "
                           "on the GPU")
_FRAGMENTATION_DEFAULT_SOURCE = "default assumption; run `memtrain calibrate` on the GPU to measure it"
_WORKSPACE_DEFAULT_SOURCE = ("default 64 MiB: two cuBLAS workspaces (forward thread, backward thread) of "
                             "32 MiB, torch's Hopper default, as measured on an H100 (docs/bench/gpu.md); "
                             "run `memtrain calibrate` on the GPU")


@dataclass(frozen=True)
class Overheads:
    """Per-device memory beyond live tensors, and where each number comes from."""

    cuda_context_bytes: int
    cuda_context_source: str
    fragmentation: float
    fragmentation_source: str
    workspace_bytes: int = 0
    workspace_source: str = ""


def profile_path() -> Path:
    """Where the calibration profile lives (``$MEMTRAIN_CALIBRATION`` overrides)."""
    override = os.environ.get(ENV_VAR)
    return Path(override) if override else Path.home() / ".cache" / "memtrain" / "calibration.json"


_NUMBERS = ("cuda_context_bytes", "cuda_workspace_bytes", "fragmentation")  # in "overheads"


def load_profile(path: Path | None = None) -> dict[str, Any] | None:
    """The saved profile, or None when there is none or it cannot be read: not JSON, or not in the
    shape `memtrain calibrate` writes (an object; ``rates`` an object of objects, one per device;
    ``overheads`` an object whose sizes are numbers). A file that is there but unreadable is said
    (a warning naming it), and ignored: the rates are measured again and saved over it."""
    path = path or profile_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    try:
        profile = json.loads(text)
    except ValueError as err:
        return _unreadable(path, f"not JSON ({err})")
    if not isinstance(profile, dict):
        return _unreadable(path, f"a JSON {type(profile).__name__}, not an object")
    rates, measured = profile.get("rates") or {}, profile.get("overheads") or {}  # calibrate writes null
    if not isinstance(rates, dict) or not all(isinstance(r, dict) for r in rates.values()):
        return _unreadable(path, "`rates` is not an object of one object per device")
    if not isinstance(measured, dict) or any(
            not isinstance(measured.get(k), int | float | None) or isinstance(measured.get(k), bool)
            for k in _NUMBERS):
        return _unreadable(path, f"`overheads` is not an object whose {', '.join(_NUMBERS)} are numbers")
    return profile


def _unreadable(path: Path, why: str) -> None:
    log.warning("the calibration profile %s cannot be used (%s): ignored; memtrain measures the rates "
                "it needs again and saves them over it (`memtrain calibrate` writes a whole one)", path, why)
    return None


def overheads(path: Path | None = None) -> Overheads:
    """The overheads the estimator adds for a CUDA run: measured if calibrated, else the defaults."""
    path = path or profile_path()
    measured = (load_profile(path) or {}).get("overheads") or {}
    context = measured.get("cuda_context_bytes")
    workspace = measured.get("cuda_workspace_bytes")
    fragmentation = measured.get("fragmentation")
    device = measured.get("device", "the GPU")
    fragmentation_source = f"measured on {device} ({path})"
    # a profile without "allocator" predates memtrain's allocator settings: the default allocator
    measured_under = measured.get("allocator", "the default allocator settings")
    if fragmentation is not None and (allocator.expandable_segments(measured.get("allocator", "none"))
                                      != allocator.expandable_segments()):
        fragmentation_source += (f", under {measured_under}, while this run uses {allocator.settings()}: "
                                 "run `memtrain calibrate` on the GPU again")
    return Overheads(
        cuda_context_bytes=int(context) if context is not None else DEFAULT_CUDA_CONTEXT,
        cuda_context_source=(f"measured on {device} ({path})" if context is not None
                             else _CONTEXT_DEFAULT_SOURCE),
        fragmentation=float(fragmentation) if fragmentation is not None else default_fragmentation(),
        fragmentation_source=(fragmentation_source if fragmentation is not None
                              else _FRAGMENTATION_DEFAULT_SOURCE + f" (under {allocator.settings()})"),
        workspace_bytes=int(workspace) if workspace is not None else DEFAULT_CUDA_WORKSPACES,
        workspace_source=(f"measured on {device} ({path})" if workspace is not None
                          else _WORKSPACE_DEFAULT_SOURCE),
    )


def default_fragmentation() -> float:
    """The uncalibrated fragmentation fraction for the allocator settings in effect."""
    return DEFAULT_FRAGMENTATION if allocator.expandable_segments() else DEFAULT_FRAGMENTATION_CACHING


# ---------------------------------------------------------------------------------- measuring


def calibrate(path: Path | None = None, quick: bool = False) -> dict[str, Any]:
    """Measure overheads (GPU only) and speed rates (CPU and GPU), save and return the profile.

    Args:
        path: where to write the profile (default :func:`profile_path`).
        quick: smaller, shorter measurements (tests; rough numbers).
    """
    path = path or profile_path()
    before = _device_used_bytes() if cuda_available() and not torch.cuda.is_initialized() else None
    profile: dict[str, Any] = {
        "version": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "host": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                 "cpus": os.cpu_count()},
        "rates": {"cpu": measure_rates("cpu", quick)},
        "overheads": None,
        "notes": [],
    }
    if cuda_available():
        configure_allocator()  # measure under the settings memtrain's runs use
        release_cached_memory()  # a cached segment left by earlier work would take the first blocks
        profile["overheads"] = measure_gpu_overheads(before, quick)
        profile["rates"]["cuda"] = measure_rates("cuda", quick)
        release_cached_memory()  # the process goes on (plan --tune, a run): give the cache back
    else:
        profile["notes"].append("no CUDA device: GPU memory overheads cannot be measured on this machine; "
                                "estimates for CUDA runs keep the documented defaults")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2), encoding="utf-8")
    profile["path"] = str(path)
    return profile


def measure_rates(device: str, quick: bool = False) -> dict[str, Any]:
    """Matmul FLOP/s per dtype, memory copy bandwidth and (CUDA) host<->device bandwidth.

    CPU rates depend on the threads torch uses; they are recorded as ``threads`` and a profile
    measured with other threads is measured again (:func:`memtrain.plan.costmodel.rates`).
    """
    dev = torch.device(device)
    n = (512 if quick else 1024) if dev.type == "cpu" else (2048 if quick else 8192)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if dev.type == "cuda":
        dtypes["fp16"] = torch.float16
    matmul = {}
    for name, dtype in dtypes.items():
        a = torch.randn(n, n, device=dev).to(dtype)
        seconds = _best_time(lambda a=a: a @ a, dev, repeats=3 if quick else 5)
        matmul[name] = 2 * n**3 / seconds
    size = (16 if quick else 256) * 2**20 if dev.type == "cuda" else (8 if quick else 64) * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = _best_time(lambda: dst.copy_(src), dev)
    rates: dict[str, Any] = {"version": RATES_VERSION, "matmul_flops": matmul, "matmul_size": n,
                             "memory_bandwidth": 2 * size / copy}
    if dev.type == "cpu":
        rates["threads"] = torch.get_num_threads()
    tiny = torch.ones(16, device=dev)
    rates["op_seconds"] = _best_time(lambda: [tiny.add(1.0) for _ in range(100)], dev) / 100
    rates["optimizer_seconds_per_parameter"] = _optimizer_rates(dev, quick)
    rates["dequantize_nf4_elements"] = _dequantize_rate(dev, quick)
    if dev.type == "cuda":
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        to_device = _best_time(lambda: src.copy_(host, non_blocking=True), dev)
        to_host = _best_time(lambda: host.copy_(src, non_blocking=True), dev)
        rates["host_to_device_bandwidth"] = size / to_device
        rates["device_to_host_bandwidth"] = size / to_host
    return rates


def _optimizer_rates(device: torch.device, quick: bool) -> dict[str, float]:
    """Seconds per parameter of one optimizer step (state already created), per optimizer."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from memtrain.trainer.trainer import OPTIMIZERS

    numel = (2 if quick else 8) * 2**20
    out = {}
    for name, (optim, optim_args) in OPTIMIZERS.items():
        if name.startswith("paged") and device.type != "cuda":
            continue  # falls back to the non-paged optimizer off CUDA
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, optim=optim, optim_args=optim_args, report_to="none",
                                     use_cpu=device.type == "cpu")
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        params = [torch.nn.Parameter(torch.randn(numel // 4, 4, device=device)) for _ in range(4)]
        for p in params:
            p.grad = torch.randn_like(p)
        try:
            opt = cls(params, **kwargs)
            out[name] = _best_time(opt.step, device, repeats=3) / sum(p.numel() for p in params)
        except (ImportError, RuntimeError, ValueError):  # no kernel for this device
            continue
    return out


def _dequantize_rate(device: torch.device, quick: bool) -> float | None:
    """NF4 weight elements dequantized per second (what a QLoRA forward pays per weight)."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        return None
    n = 1024 if quick else 2048
    weight = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(weight, quant_type="nf4")
    return n * n / _best_time(lambda: bnbf.dequantize_4bit(packed, state), device, repeats=3)


def _best_time(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs: the hardware's speed, not the load of the moment.

    The median was not enough: a quick profile measured while another process had the cores
    recorded 4.2 GFLOP/s for fp32 matmul where the same machine does 60 GFLOP/s, and the planner
    then saw every step as matmul-bound.
    """
    fn()  # warm-up (kernel selection, lazy loading)
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)


def measure_gpu_overheads(used_before: int | None, quick: bool = False) -> dict[str, Any]:
    """CUDA context bytes, cuBLAS workspaces and allocator fragmentation on the current GPU, under
    the allocator settings memtrain's runs use (see module docstring)."""
    device = torch.device("cuda", torch.cuda.current_device())
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "allocator": allocator.settings()}
    result["cuda_workspace_bytes"] = _workspace_bytes(device)
    result["fragmentation"] = _fragmentation(device, quick)
    # after real training steps: the kernels a step loads (attention, loss, optimizer) are in the
    # context; after one matmul it was 83 MiB short of what every training run showed on an H100
    used_after = _device_used_bytes()
    if used_before is not None and used_after is not None:
        result["cuda_context_bytes"] = max(0, used_after - used_before - torch.cuda.memory_reserved(device))
        result["cuda_context_method"] = ("nvidia-smi memory.used before CUDA init and after training steps, "
                                         "minus reserved")
    return result


def _workspace_bytes(device: torch.device) -> int:
    """What cuBLAS keeps allocated once a step ran: a workspace per thread that runs matmuls (the
    main thread and autograd's backward thread), held in the caching allocator, so counted by
    ``max_memory_allocated`` beside the tensors (64-66 MiB above the traced tensors on every row of
    an H100: 2 x 32 MiB, torch's Hopper default)."""
    clear_cublas_workspaces()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    w = torch.randn(512, 512, device=device, requires_grad=True)
    (torch.randn(512, 512, device=device) @ w).sum().backward()  # forward here, backward on autograd's thread
    del w
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.memory_allocated(device) - before)


def release_cached_memory() -> int:
    """Collect what calibration left and return the allocator's cached blocks to the driver;
    the bytes still reserved afterwards (0 when calibration freed everything)."""
    import gc

    gc.collect()
    if not cuda_available():
        return 0
    torch.cuda.synchronize()
    # cuBLAS keeps its workspaces in the caching allocator: a segment holding one is never freed
    # (on an H100 a 3 GiB segment stayed reserved after calibration, pinned by the workspace)
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_reserved())


def _device_used_bytes() -> int | None:
    """Device-wide used memory from nvidia-smi (reading it does not create a context here)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.strip().splitlines()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _fragmentation(device: torch.device, quick: bool) -> float:
    """Reserved-but-unallocated bytes over the bytes a step allocates and frees, during a few
    AdamW steps of a small Llama-shaped model (after a first step that creates optimizer state)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=2 if quick else 6,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
    model = AutoModelForCausalLM.from_config(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.empty_cache()
    resident = 0  # weights and optimizer state: what lives from one step to the next
    for step in range(3 if quick else 8):
        if step == 1:  # optimizer state exists now: measure the steps after it
            resident = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        batch, length = (4, 256) if step % 2 else (8, 512)  # varying shapes, as real data does
        ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    del model, optimizer
    torch.cuda.empty_cache()
    transient = allocated - resident  # the estimator applies the fraction to the same base
    return max(0.0, (reserved - allocated) / transient) if transient > 0 else DEFAULT_FRAGMENTATION
