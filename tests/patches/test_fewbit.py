"""Few-bit activation backward: tables, bit packing, exact forward, measured error and bytes."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import MINILM, TINY_CONFIGS, tiny_model
from torch import nn

from memtrain import patches
from memtrain.config import FewBitConfig, load_recipe
from memtrain.errors import MemtrainError
from memtrain.patches import NoMatchError, fewbit
from memtrain.patches._fewbit_tables import FUNCTIONS, derivative, fewbit_table, normal_pdf
from memtrain.patches.fewbit import FewBitActivation, identify, pack_codes, unpack_codes


def saved_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes of the distinct storages saved for backward by ``fn()`` (parameters excluded)."""
    storages: dict[int, int] = {}
    params: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):
            params.add(t.untyped_storage().data_ptr())
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()  # kept alive by the caller, so no storage address is reused meanwhile
    return sum(n for ptr, n in storages.items() if ptr not in params), out


# ------------------------------------------------------------------------------------ tables


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_table_shape_and_error_ordering(function: str) -> None:
    errors = []
    for bits in (1, 2, 3):  # 4 bits: see the GELU case below (each 4-bit table takes ~1 s)
        table = fewbit_table(function, bits)
        assert len(table.levels) == 2**bits and len(table.boundaries) == 2**bits - 1
        assert list(table.boundaries) == sorted(table.boundaries)
        errors.append(table.error)
    variance = fewbit_table(function, 1).variance
    if function == "relu":  # a step function: one bit is exact
        assert errors == [0.0, 0.0, 0.0]
    else:
        assert variance > errors[0] > errors[1] > errors[2] > 0
    if function == "gelu":
        four = fewbit_table(function, 4)
        assert len(four.levels) == 16 and 0 < four.error < errors[2]


def test_table_is_optimal_against_perturbed_boundaries() -> None:
    from memtrain.patches._fewbit_tables import _levels_and_error

    table = fewbit_table("gelu", 2)
    rng = random.Random(0)
    for _ in range(8):
        moved = tuple(sorted(b + rng.uniform(-0.1, 0.1) for b in table.boundaries))
        assert _levels_and_error("gelu", moved)[1] >= table.error - 1e-12


def test_gelu_derivative_is_antisymmetric_so_the_table_is() -> None:
    # GELU'(-x) = 1 - GELU'(x): the optimal table mirrors around (0, 0.5).
    table = fewbit_table("gelu", 3)
    assert table.boundaries == pytest.approx([-b for b in reversed(table.boundaries)], abs=1e-9)
    assert table.levels == pytest.approx([1 - v for v in reversed(table.levels)], abs=1e-6)


# ----------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 1000])
def test_pack_round_trip_and_size(bits: int, n: int) -> None:
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (bits, math.ceil(n / 8))
    assert torch.equal(unpack_codes(packed, bits)[:n], codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_saved_bytes_per_element_is_bits_over_8(bits: int) -> None:
    act = FewBitActivation(nn.GELU(), "gelu", bits)
    x = torch.randn(16, 64, 24, requires_grad=True)
    nbytes, _out = saved_bytes(lambda: act(x * 1.0))
    assert nbytes / x.numel() == bits / 8
    plain, _out2 = saved_bytes(lambda: nn.GELU()(x * 1.0))
    assert plain / x.numel() == 4


def test_chunked_encoding_matches_single_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    act = FewBitActivation(nn.SiLU(), "silu", 3)
    x = torch.randn(1003, requires_grad=True)
    act(x).backward(torch.ones_like(x))
    whole = x.grad.clone()
    monkeypatch.setattr(fewbit, "_CHUNK", 64)  # many chunks, and a ragged last one
    x.grad = None
    act(x).backward(torch.ones_like(x))
    assert torch.equal(x.grad, whole)


# ------------------------------------------------------------------------- measured error


@pytest.mark.parametrize("function,module", [
    ("gelu", nn.GELU()), ("gelu_tanh", nn.GELU(approximate="tanh")), ("silu", nn.SiLU()),
    ("relu", nn.ReLU()), ("quick_gelu", None), ("tanh", nn.Tanh()),
])
def test_measured_derivative_error_equals_table(function: str, module: nn.Module | None) -> None:
    """Quadrature of (f' - backward)^2 p over a fine grid reproduces the table's error."""
    if module is None:
        from transformers.activations import QuickGELUActivation

        module = QuickGELUActivation()
    act = FewBitActivation(module, function, 3)
    x = torch.linspace(-8, 8, 400_001, dtype=torch.float32, requires_grad=True)
    act(x).backward(torch.ones_like(x))
    grid = x.detach().double()
    weight = normal_pdf(grid) * (16 / 400_000)  # not grid[1] - grid[0]: float32 spacing is off
    measured = float((weight * (derivative(function, grid) - x.grad.double()) ** 2).sum())
    assert measured == pytest.approx(fewbit_table(function, 3).error, rel=1e-3, abs=1e-9)


def test_measured_error_on_normal_samples_matches_within_sampling_error() -> None:
    """A statistical check: mean squared derivative error of N(0,1) samples vs the table."""
    torch.manual_seed(1)
    x = torch.randn(1_000_000, dtype=torch.float32, requires_grad=True)
    FewBitActivation(nn.GELU(), "gelu", 3)(x).backward(torch.ones_like(x))
    sq = (derivative("gelu", x.detach().double()) - x.grad.double()) ** 2
    standard_error = float(sq.std()) / math.sqrt(sq.numel())
    assert abs(float(sq.mean()) - fewbit_table("gelu", 3).error) < 5 * standard_error


# ---------------------------------------------------------------------------------- patching


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_forward_bit_identical_and_default_targets(arch: str) -> None:
    model = tiny_model(arch)
    model.train()  # dropout on: the patch must not touch the RNG either
    ids = torch.randint(0, 512, (2, 16))
    torch.manual_seed(5)
    before = model(input_ids=ids).logits
    fewbit.apply(model, FewBitConfig(bits=3))
    torch.manual_seed(5)
    after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    (record,) = patches.records(model)
    assert len(record.modules) == 2  # one MLP activation per layer
    assert all(isinstance(model.get_submodule(n), FewBitActivation) for n in record.modules)
    after.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_memory_saved_in_a_bert_step_is_exactly_the_gelu_inputs() -> None:
    model = tiny_model("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 512, (4, 64))
    vanilla, _ = saved_bytes(lambda: model(input_ids=ids).logits)
    fewbit.apply(model, FewBitConfig(bits=3))
    patched, _ = saved_bytes(lambda: model(input_ids=ids).logits)
    gelu_inputs = 2 * 4 * 64 * TINY_CONFIGS["bert"]["intermediate_size"]  # 2 layers
    assert vanilla - patched == gelu_inputs * (4 - 3 / 8)


def test_lora_wrapped_model_recipe_hook_and_undo(tmp_path: Any) -> None:
    rec = {"model": {"from_config": {**TINY_CONFIGS["bert"], "vocab_size": 512},
                     "tokenizer": MINILM, "task": "sequence-classification"},
           "data": {"source": str(tmp_path / "x.csv"), "format": "classification"},
           "memory": {"activation_bits": 2}}
    (tmp_path / "x.csv").write_text("text,label\na,0\nb,1\n", encoding="utf-8")
    cfg = load_recipe(rec)
    model = patches.get("lora")(tiny_model("bert"), cfg)
    model = patches.apply_patches(model, cfg, only=["fewbit"])
    record = patches.records(model)[-1]
    assert record.name == "fewbit" and len(record.modules) == 2
    assert record.modules[0].startswith("base_model.model.bert.encoder.layer.0")
    assert model.get_submodule(record.modules[0]).bits == 2
    record.undo()
    assert all(type(model.get_submodule(n)).__name__ == "GELUActivation" for n in record.modules)


def test_under_fake_tensors_and_meta_the_estimate_equals_the_measurement() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak(mode: Any) -> int:
        with mode:
            model = fewbit.apply(tiny_model("llama", intermediate_size=512), FewBitConfig(bits=3))
            ids = torch.randint(0, 512, (4, 128))
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                model(input_ids=ids).logits.sum().backward()
            return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    assert peak(FakeTensorMode()) == peak(torch.device("cpu"))
    with torch.device("meta"):  # patched while on meta, too (the probe and tables stay on CPU)
        model = fewbit.apply(tiny_model("llama"), FewBitConfig(bits=3))
        ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids).logits.sum().backward()
    grad = model.model.layers[0].mlp.gate_proj.weight.grad
    assert grad is not None and grad.device.type == "meta"


# ------------------------------------------------------------------------ identification


def test_identify_dispatch_and_probe() -> None:
    from transformers import activations as act

    assert identify(act.GELUActivation()) == "gelu"
    assert identify(act.NewGELUActivation()) == "gelu_tanh"
    assert identify(act.SiLUActivation()) == "silu"
    assert identify(nn.ReLU(inplace=True)) == "relu"
    assert identify(act.ClippedGELUActivation(-10, 10)) is None  # other derivative
    swapped = act.GELUActivation()
    swapped.act = torch.tanh  # right type, wrong function: the probe catches it
    assert identify(swapped) is None


def test_probe_names_a_model_own_activation_class_by_its_values() -> None:
    class OwnGelu(nn.Module):  # e.g. BLOOM's BloomGelu: a type no matcher lists
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 0.5 * (1.0 + torch.tanh(0.7978845608 * x * (1.0 + 0.044715 * x * x)))

    class TwoInputs(nn.Module):  # a rotary embedding, say: the probe's call fails
        def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return x * positions

    assert identify(OwnGelu()) == "gelu_tanh"
    assert identify(TwoInputs()) is None and identify(nn.LayerNorm(4, elementwise_affine=False)) is None
    state = torch.random.get_rng_state()
    assert identify(nn.Dropout(0.5)) is None and identify(nn.RReLU()) is None  # random: no match
    assert torch.equal(torch.random.get_rng_state(), state)  # and the global RNG did not move


def test_inplace_relu_keeps_working() -> None:
    act = FewBitActivation(nn.ReLU(inplace=True), "relu", 1)
    x = torch.randn(100, requires_grad=True)
    y = act(x * 1.0)
    y.backward(torch.ones_like(y))
    assert torch.equal(y, torch.relu(x.detach()))
    assert torch.equal(x.grad, (x.detach() > 0).float())  # 1 bit is exact for ReLU


# -------------------------------------------------------------------------------- failures


def test_pattern_matching_nothing_raises() -> None:
    with pytest.raises(NoMatchError, match=r"memory\.activation_targets.*intermediate_act_fn"):
        fewbit.apply(tiny_model("bert"), FewBitConfig(bits=3, targets=["mlp.act_fn"]))


def test_a_model_without_repeated_blocks_needs_targets() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    with pytest.raises(MemtrainError, match=r"no default targets.*set `memory\.activation_t.*e\.g\. 1\."):
        fewbit.apply(model, FewBitConfig(bits=3))
    fewbit.apply(model, FewBitConfig(bits=3, targets=["1"]))  # explicit targets work
    assert isinstance(model[1], FewBitActivation)


def test_bad_bits_in_recipe_is_reported(tmp_path: Any) -> None:
    from memtrain.config import RecipeError

    rec = {"model": {"from_config": TINY_CONFIGS["bert"], "tokenizer": MINILM},
           "data": {"source": "builtin:shakespeare-text"}, "memory": {"activation_bits": 5}}
    with pytest.raises(RecipeError, match="activation_bits"):
        load_recipe(rec)


def test_each_user_pattern_must_match() -> None:
    model = tiny_model("bert")
    with pytest.raises(NoMatchError, match=r"\['intermediate_act_fm'\]"):
        fewbit.apply(model, FewBitConfig(bits=3, targets=["intermediate_act_fn", "intermediate_act_fm"]))
