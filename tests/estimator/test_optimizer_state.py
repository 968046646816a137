"""The optimizer state a trace starts from (memtrain.estimator.trace.create_optimizer_state): the
state of a first real step, made with torch's multi-tensor kernels in a few ops (a trace's cost is
its number of ops; LoRA has hundreds of small parameters)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.estimator.trace import create_optimizer_state


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(30)])  # 60 parameters


def _state(optimizer: torch.optim.Optimizer) -> list[dict[str, tuple]]:
    return [{k: (tuple(v.shape), v.dtype, v.device) if torch.is_tensor(v) else v for k, v in s.items()}
            for s in optimizer.state.values()]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
], ids=["adamw", "sgd", "adam-amsgrad"])
def test_the_state_is_a_first_steps_in_a_few_ops(make):
    model = _model()
    reference = copy.deepcopy(model)
    ref_opt = make(reference.parameters())
    with _Ops() as single:
        for p in reference.parameters():
            p.grad = torch.zeros_like(p)
        ref_opt.step()  # a first step, as the Trainer's first step on these parameters makes it

    optimizer = make(model.parameters())
    before = [group["foreach"] for group in optimizer.param_groups]
    with _Ops() as ops:
        create_optimizer_state(model, optimizer)
    assert _state(optimizer) == _state(ref_opt)
    for group, state in zip(optimizer.param_groups, optimizer.state.values(), strict=False):
        assert all(p.grad is None for p in group["params"]) and state
    assert [group["foreach"] for group in optimizer.param_groups] == before  # the traced step's own path
    # the state's own tensors are made one by one either way; the update is a kernel per term for
    # all 60 parameters instead of one per term and parameter (SGD's first step: one term)
    assert ops.count < single.count - 50


def test_an_optimizer_without_multi_tensor_kernels_takes_its_own_step():
    from transformers.optimization import Adafactor

    model = _model()
    optimizer = Adafactor(model.parameters(), lr=1e-3, relative_step=False)
    create_optimizer_state(model, optimizer)
    assert len(optimizer.state) == 60 and "foreach" not in optimizer.param_groups[0]
