"""Fake tensors (``torch._subclasses``): what the estimator's fake mode needs that torch's does not
do, each a context manager (:func:`memtrain.estimator.fake.fake_tensor_mode` enters them; its module
docstring says why each is needed).

What it touches: the fake mode's tensor memo, ``torch.utils.swap_tensors`` and
``FakeTensor.__deepcopy__`` (patched while inside), ``torch._subclasses.fake_impls``'s
``op_implementations_checks`` (a rule put first, removed on exit), ``torch._meta_registrations``'
``_create_grouped_mm_output_tensor``, and the private ops ``aten._grouped_mm`` and
``aten._local_scalar_dense``. torch has no public API to register a fake implementation for an op
that already has a meta kernel (``torch.library.register_fake`` refuses built-in aten ops).

Checked on torch 2.13.0 (this CPU) and 2.11 (the GPU image, docs/devices.md); tested range
:data:`memtrain._compat.versions.TESTED` (2.10–2.15).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from memtrain._compat.torch_tools import FakeTensor, FakeTensorMode, private_op


@contextmanager
def swappable_fakes(mode: FakeTensorMode) -> Iterator[None]:
    """Inside: ``torch.utils.swap_tensors`` works on fake tensors (peft and ``nn.Module._apply``
    swap parameters): the fake mode's memo holds weak references (``KeyedRef``) to them, which
    ``swap_tensors`` refuses, so their keys are dropped from the memo first. Touches
    ``mode.fake_tensor_converter.meta_converter.tensor_memo`` and patches ``torch.utils.swap_tensors``
    process-wide while inside: no public way to swap tensors a fake mode has memoized."""
    original: Callable[[torch.Tensor, torch.Tensor], None] = torch.utils.swap_tensors
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        keys = [r.key for t in (t1, t2) for r in weakref.getweakrefs(t) if isinstance(r, weakref.KeyedRef)]
        for key in keys:  # the KeyedRef objects must be gone before swapping: keep only their keys
            memo.pop(key, None)
        original(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextmanager
def deepcopyable_fakes() -> Iterator[None]:
    """Inside: ``copy.deepcopy`` of a fake tensor gives a fake tensor with the same attributes
    (a 4-bit weight's ``quant_state``) instead of failing. Sets ``FakeTensor.__deepcopy__`` while
    inside: fake tensors have no deepcopy of their own."""
    def deepcopy(self: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if isinstance(self, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        else:
            new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        for key, value in self.__dict__.items():  # user attributes, e.g. a 4-bit weight's quant_state
            if key not in new.__dict__:  # (not the fake mode's own bookkeeping)
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    FakeTensor.__deepcopy__ = deepcopy  # type: ignore[method-assign]
    try:
        yield
    finally:
        del FakeTensor.__deepcopy__


@contextmanager
def fake_rule(op: Any, impl: Callable[..., Any]) -> Iterator[None]:
    """Answer ``op`` with ``impl(mode, func, *args, **kwargs)`` in fake modes, ahead of its meta kernel
    (``NotImplemented`` leaves it to the meta kernel); removed on exit."""
    from torch._subclasses import fake_impls

    rule = (lambda func: func is op, impl)
    fake_impls.op_implementations_checks.insert(0, rule)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(rule)


def grouped_mm_any_float() -> Any:
    try:
        from torch._meta_registrations import _create_grouped_mm_output_tensor as output_like
    except ImportError:  # a torch without the helper: its meta kernel answers alone
        return contextlib.nullcontext()

    def grouped_mm(mode: FakeTensorMode, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor,
                   offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> Any:
        dtype = mat_a.dtype
        if (dtype == torch.bfloat16 or dtype != mat_b.dtype or not dtype.is_floating_point
                or bias is not None or offs is None):
            return NotImplemented  # the meta kernel's own rules (and errors)
        with mode:
            return output_like(mat_a, mat_b, offs, out_dtype or dtype)

    return fake_rule(private_op("_grouped_mm"), grouped_mm)


def largest_nonzero() -> Any:
    def nonzero(mode: FakeTensorMode, func: Any, tensor: torch.Tensor) -> Any:
        with mode:
            return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)

    return fake_rule(torch.ops.aten.nonzero.default, nonzero)


@contextmanager
def any_scalar() -> Iterator[None]:
    def one(mode: FakeTensorMode, func: Any, tensor: torch.Tensor) -> Any:
        return True if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 1

    with ExitStack() as stack:
        for op in (private_op("_local_scalar_dense"), torch.ops.aten.item.default):
            stack.enter_context(fake_rule(op, one))
        yield


