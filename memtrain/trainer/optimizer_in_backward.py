"""The optimizer step inside backward (``training.optimizer_in_backward``).

Saves: the gradients of the whole model. Each trainable parameter gets an optimizer of its own,
stepped in the parameter's post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``)
the moment backward has finished its gradient, which is freed right after. At the backward peak
only the gradients of the parameters whose step has not come yet exist, instead of all of them
(for full fine-tuning of a bf16 model: 2 bytes per parameter). torchtune calls this
"optimizer in backward"; its recipes do the same with one optimizer per parameter.

Costs: no extra compute, but no global view of the gradients: no gradient accumulation (the step
happens in every backward), no clipping by the global norm, no fp16 loss scaling. The recipe
schema refuses those combinations (``memtrain.config.schema``).

Inside the Hugging Face Trainer, :class:`OptimizerInBackward` stands in for the optimizer: its
``param_groups`` are the per-parameter optimizers' own groups, so the Trainer's learning-rate
scheduler sets the rate every per-parameter step uses; ``step()`` only steps parameters whose
gradient was set by other means (none, in training) and ``state_dict()`` / ``load_state_dict()``
save and restore every per-parameter optimizer, so checkpoints and resume work unchanged.
torch has no such wrapper (torchtune's ``OptimizerInBackwardWrapper`` is tied to its recipes), so
this one is written here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped by its parameter's gradient hook.

    Args:
        optimizers: parameter -> the optimizer that updates it (exactly that parameter).
    """

    def __init__(self, optimizers: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        # torch.optim.Optimizer.__init__ would make param groups of its own; the scheduler must
        # see the per-parameter optimizers' groups instead, so only the bookkeeping is set up.
        self.optimizers = optimizers
        self.defaults: dict[str, Any] = {}
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._handles = [param.register_post_accumulate_grad_hook(self._step_param)
                         for param in optimizers]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self) -> dict[nn.Parameter, dict[str, Any]]:  # type: ignore[override]
        """Every parameter's optimizer state (the meter and the Trainer read it)."""
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def _step_param(self, param: nn.Parameter) -> None:
        self.optimizers[param].step()
        param.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the parameters that hold a gradient: in training none do (their hooks stepped
        them during backward); gradients set by hand (e.g. to create optimizer state) are used."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param in self.optimizers:
            if param.grad is not None:
                self._step_param(param)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.optimizers:
            param.grad = None

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"in_backward": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        saved = state_dict.get("in_backward")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError(
                f"this optimizer state holds {'no per-parameter optimizers' if saved is None else len(saved)}"
                f" where {len(self.optimizers)} are needed: it was saved with another "
                "`training.optimizer_in_backward` setting or model. Fix: resume with the settings the "
                "checkpoint was written with.")
        for opt, sd in zip(self.optimizers.values(), saved, strict=True):
            opt.load_state_dict(sd)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("the optimizer in backward has one group per parameter")

    def remove_hooks(self) -> None:
        """Detach from the parameters (their gradients accumulate normally again)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        inner = type(next(iter(self.optimizers.values()))).__name__ if self.optimizers else "none"
        return f"OptimizerInBackward({len(self.optimizers)} × {inner})"


def build(groups: Iterable[dict[str, Any]], optimizer_cls: type, kwargs: dict[str, Any]
          ) -> OptimizerInBackward:
    """One ``optimizer_cls`` per parameter of ``groups`` (each keeps its group's settings)."""
    overrides = _bnb_overrides(optimizer_cls)
    optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
    for group in groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            own = overrides.get(id(param))
            opt = optimizer_cls([{**settings, "params": [param]}], **{**kwargs, **(own or {})})
            if overrides:
                # bitsandbytes files overrides by (group, index) in a process-wide table, and every
                # per-parameter optimizer has the index (0, 0): one embedding's 32-bit override would
                # turn every later parameter's state to 32 bits. The override is in `own` instead.
                opt.check_overrides = lambda: None  # type: ignore[method-assign]
            optimizers[param] = opt
    return OptimizerInBackward(optimizers)


def _bnb_overrides(optimizer_cls: type) -> dict[int, dict[str, Any]]:
    """bitsandbytes' per-parameter settings (e.g. 32-bit state for embeddings), by parameter id."""
    if not optimizer_cls.__module__.startswith("bitsandbytes"):
        return {}
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    return {id(getattr(module, attr)): dict(config)
            for module, attr, config in manager.module_weight_config_triple}
