"""torch internals other than the memory trackers (those are :mod:`memtrain._compat.torch_trackers`).

Each function says what it touches and why no public API does it. Checked on torch 2.13.0 (this
CPU, the pinned version) and 2.11 (the GPU image, docs/devices.md: the suite passes but the
CUDA-only tests); the tested range is :data:`memtrain._compat.versions.TESTED` (2.10–2.15).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

# Fake tensors: the estimator traces a step on them. ``torch._subclasses`` is private, and torch
# documents no public import path for these names (torch.compile's docs import them from here too).
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake, unset_fake_temporarily
from torch.utils._pytree import tree_leaves

from memtrain._compat.versions import private

__all__ = ["FakeTensor", "FakeTensorMode", "active_fake_mode", "backward_hooks", "clear_cublas_workspaces",
           "extra_flop_formulas", "fake_device", "foreach_mul_", "is_fake", "keep_on_device",
           "module_tensor_tables", "overload_packet", "post_accumulate_grad_hooks",
           "selective_checkpoint_options", "set_allocator_settings", "tensor_base", "tensor_version",
           "tree_leaves", "unset_fake_temporarily"]

_SHIM = "torch_tools"


def overload_packet(func: Any) -> Any:
    """The ``OpOverloadPacket`` of an op overload (``aten.mm.default`` -> ``aten.mm``), the key of
    ``torch.utils.flop_counter.flop_registry``. Touches ``OpOverload._overloadpacket``: torch has no
    public accessor (``FlopCounterMode`` reads the same attribute)."""
    return private(func, "_overloadpacket", f"{_SHIM}.overload_packet", "torch")


def fake_device(tensor: Any) -> torch.device | None:
    """The device a fake tensor reports, as ``FakeTensor`` answers ``prim.device`` itself (its
    ``fake_device`` outside a kernel; checked on torch 2.11 and 2.13); None for anything else, or
    inside a kernel, where the fake mode answers ``meta`` (ask the op then)."""
    if isinstance(tensor, FakeTensor) and not tensor.fake_mode.in_kernel_invocation:
        return tensor.fake_device
    return None


@functools.cache
def selective_checkpoint_options() -> dict[str, Any]:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint`` under a selective checkpoint:
    the tensors it keeps stay out of the saved-tensor hooks around it (memtrain's activation
    offload), as every tested torch has done. torch 2.14 and 2.15 take
    ``respect_saved_tensors_hooks``, warn on each checkpointed layer until told, and say a later
    release routes them through the hooks by default. Told ``True``, 2.15 fails the recompute of a
    layer under memtrain's offload hooks when a counting dispatch mode runs around the step (as
    memtrain's meter and memprobe do): "aten.to.dtype encountered during backward but not found in
    storage" (without such a mode, or with torch's own ``save_on_cpu``, it trains; the cause is not
    yet known), so they are told ``False``. 2.13 and 2.10 have no such argument (and ``checkpoint``
    passes keyword arguments it does not know to the checkpointed function): nothing then. Read
    from the signature."""
    from torch.utils.checkpoint import checkpoint

    taken = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    return {"respect_saved_tensors_hooks": False} if taken else {}


def clear_cublas_workspaces() -> bool:
    """Free cuBLAS's per-thread workspaces, which sit in the caching allocator (a segment holding
    one is never returned). Touches ``torch._C._cuda_clearCublasWorkspaces``: no public API; a torch
    without it (or without CUDA) leaves them, as before. Returns whether it cleared."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def set_allocator_settings(settings: str) -> bool:
    """Apply ``PYTORCH_CUDA_ALLOC_CONF``-style ``settings`` to an allocator already running.
    Touches ``torch.cuda.memory._set_allocator_settings`` (torch reads the variable only when CUDA
    starts; no public setter). Returns False where this torch has none (nothing applied)."""
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False
    setter(settings)
    return True


def backward_hooks(tensor: torch.Tensor) -> Any:
    """A tensor's ``_backward_hooks`` dict (hook id -> hook; None when it has none). torch offers
    handles for the hooks one registers, but not for those its own modules add."""
    return tensor._backward_hooks


def post_accumulate_grad_hooks(param: torch.Tensor) -> Any:
    """A parameter's ``_post_accumulate_grad_hooks`` dict (hook id -> hook; None when none):
    torchao's ``CPUOffloadOptimizer`` keeps no handles to the hooks it adds, so removing them needs
    the dict."""
    return param._post_accumulate_grad_hooks


def tensor_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from (``Tensor._base``; None for a non-view): no public accessor."""
    return tensor._base


def tensor_version(tensor: torch.Tensor) -> int:
    """The in-place version counter (``Tensor._version``), which autograd checks saved tensors
    against: no public accessor."""
    return tensor._version


def module_tensor_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's own ``_parameters`` and ``_buffers`` dicts (to replace entries in place, as
    ``nn.Module.__setattr__`` would not for a name held as a plain attribute)."""
    return module._parameters, module._buffers


def keep_on_device(module: nn.Module) -> None:
    """Make ``module.to()`` / ``.cuda()`` (``nn.Module._apply``) leave ``module`` where it is, on this
    instance only. torch has no public way to exclude a module from ``Module.to``."""
    module._apply = lambda fn, recurse=True: module  # type: ignore[method-assign]


def foreach_mul_(tensors: list[torch.Tensor], scalar: Any) -> None:
    """``torch._foreach_mul_``: multiply every tensor in place in one kernel (what
    ``torch.nn.utils.clip_grad_norm_`` itself uses; no public name)."""
    torch._foreach_mul_(tensors, scalar)


def private_op(name: str) -> Any:
    """``torch.ops.aten.<name>.default`` for a private aten op (``_grouped_mm``,
    ``_local_scalar_dense``), or a clear error where this torch lacks it."""
    packet = private(torch.ops.aten, name, f"{_SHIM}.private_op", "torch")
    return packet.default


def extra_flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for ops a trace dispatches that torch's ``flop_registry`` lacks (checked on
    torch 2.13; looked up by name, an op this torch lacks is skipped): CPU's flash attention, which
    a fake-tensor trace on a machine without CUDA runs where CUDA runs the flash or efficient kernel
    (counted the same way), and bitsandbytes' 4-bit matmul (its forward; backward dequantizes, then
    ``mm``). Without them a trace planned here saw no attention FLOPs and no 4-bit forward matmuls.
    Built per trace: bitsandbytes registers its ops when imported."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    formulas: dict[Any, Any] = {}
    for cpu, same in ((getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
                       getattr(aten, "_scaled_dot_product_flash_attention", None)),
                      (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None),
                       getattr(aten, "_scaled_dot_product_flash_attention_backward", None))):
        if cpu is not None and same in flop_registry:
            formulas[cpu] = flop_registry[same]
    if hasattr(torch.ops, "bitsandbytes") and hasattr(torch.ops.bitsandbytes, "gemm_4bit"):
        formulas[torch.ops.bitsandbytes.gemm_4bit] = _gemm_4bit_flops
    return formulas


def flash_attention_backward_ops() -> dict[Any, str]:
    """The overload packets of SDPA's flash-attention backward that a trace dispatches, each with
    its device: CUDA's (a trace on fake CUDA tensors) and CPU's (on a machine without CUDA);
    looked up by name (private aten ops, checked on torch 2.11 and 2.13), one this torch lacks is
    left out. CPU's takes ``attn_mask`` as its ninth argument, CUDA's never has a mask."""
    aten = torch.ops.aten
    names = {"_scaled_dot_product_flash_attention_backward": "cuda",
             "_scaled_dot_product_flash_attention_for_cpu_backward": "cpu"}
    return {getattr(aten, name): device for name, device in names.items() if hasattr(aten, name)}


def _gemm_4bit_flops(a: torch.Tensor, b: Any, shape_b: Any, *args: Any, out_val: Any = None,
                     **kwargs: Any) -> int:
    """``bitsandbytes::gemm_4bit(A, B, shapeB, ...)``: ``A [..., K] @ W.T`` with ``W`` of ``shapeB``
    ``[N, K]`` stored packed in ``B``: 2 FLOPs per multiply-add, as ``mm``."""
    rows = a.numel() // max(1, a.shape[-1])
    return 2 * rows * int(shape_b[0]) * int(shape_b[1])
