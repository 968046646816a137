"""`adapter.compute_dtype: model`: the adapter's matmuls in the model's dtype (issue 39's profile:
memtrain's step at 8,192 tokens ran 2,199 matmuls, 2,859 copies and 528 fp32 GEMMs to Unsloth's
752 / 263 / none, most of the difference the exact fp32 adapter path)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from memtrain.config import AdapterConfig, RecipeError, load_recipe
from memtrain.patches import lora

IN, OUT, ROWS, RANK, ALPHA = 48, 64, 256, 8, 16


def _adapted(compute_dtype: str, dropout: float = 0.0) -> nn.Module:
    """One bf16 linear layer with a LoRA adapter through memtrain's patch, B non-zero (peft starts
    it at zero, which would hide the adapter's arithmetic)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(IN, OUT, bias=False)).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=dropout,
                                            target_modules=["0"]))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.5)
    assert layer.lora_A["default"].weight.dtype == torch.float32  # peft's fp32 adapter
    lora.lean_lora_layers(model, model_dtype=compute_dtype == "model")
    return model


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.float().square().sum().backward()
    layer = model.base_model.model[0]
    return out, x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad


def _reference(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same step in float64: the exact values both paths approximate."""
    double = copy.deepcopy(model).double()
    return _step(double, x.double())


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_the_model_dtype_path_computes_the_adapter_in_bf16_within_bf16_error() -> None:
    x = torch.randn(2, ROWS // 2, IN).to(torch.bfloat16)
    fast, exact = _adapted("model"), _adapted("fp32")
    got, want = _step(fast, x), _step(exact, x)
    ref = _reference(exact, x)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == got[3].dtype == torch.float32
    for ours, theirs, truth in zip(got, want, ref, strict=True):
        assert _error(ours, truth) < 1e-2  # bf16 has 8 bits of mantissa
        assert _error(theirs, truth) < 1e-2
    # a different path, not the exact one under another name: its matmuls round in bf16
    assert not torch.equal(got[2], want[2])


def test_the_model_dtype_path_runs_no_row_chunks_and_no_fp32_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact path's fp32 work runs over row chunks (``CHUNK_BYTES``, here 4 KiB: 16 rows of 64);
    the model-dtype path is one fused ``addmm`` forward whatever the rows, and no fp32 matmul."""
    monkeypatch.setattr(lora, "CHUNK_BYTES", 4096)
    x = torch.randn(1, ROWS, IN).to(torch.bfloat16)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[torch.dtype] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.dtypes.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    counts = {}
    for name in ("fp32", "model"):
        model = _adapted(name)
        with Matmuls() as seen:
            _step(model, x)
        counts[name] = (len(seen.dtypes), seen.dtypes.count(torch.float32))
    chunks = ROWS // (4096 // (4 * OUT))
    assert counts["fp32"][0] >= 3 * chunks  # a forward and two backward matmuls per chunk
    # forward: the base, the low rank, the fused add; backward: the base's input gradient and two
    # matmuls for each of the adapter's two (the exact path: 53, 51 of them in fp32)
    assert counts["model"] == (8, 0), counts
    assert counts["fp32"][1] > 0


def test_dropout_is_recomputed_not_kept_and_the_field_is_checked() -> None:
    """With dropout the low-rank input is recomputed in backward (as the exact path does): the step
    still trains both adapter weights."""
    model = _adapted("model", dropout=0.1)
    model.train()
    x = torch.randn(2, ROWS // 2, IN).to(torch.bfloat16)
    _, _, grad_a, grad_b = _step(model, x)
    assert grad_a is not None and grad_b is not None and grad_a.abs().sum() > 0 and grad_b.abs().sum() > 0
    assert AdapterConfig().compute_dtype == "fp32"  # exact to peft unless asked
    with pytest.raises(RecipeError, match=r"adapter.compute_dtype"):
        load_recipe({"model": {"name": "x"}, "data": {"source": "x"}, "adapter": {"compute_dtype": "bf16"}})
