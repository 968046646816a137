"""Randomized linear backward: exact forward and input grads, unbiased weight grads, bytes saved."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from conftest import MINILM, TINY_CONFIGS, tiny_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from memtrain import patches
from memtrain.config import AdapterConfig, RandomizedLinearConfig, load_recipe
from memtrain.errors import MemtrainError
from memtrain.patches import NoMatchError, lora, randomized_linear
from memtrain.patches._targets import blocks
from memtrain.patches.randomized_linear import (
    RandomizedConv1D,
    RandomizedLinear,
    sketch_product,
    sketch_rows,
)


def saved_bytes(fn: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """Bytes of the distinct storages saved for backward by ``fn()``, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()  # returned so the graph, and every saved storage, stays alive
    return sum(n for ptr, n in storages.items() if ptr not in skip), out


def weight_grad_estimates(layer: nn.Module, x: torch.Tensor, g: torch.Tensor,
                          n: int) -> torch.Tensor:
    out = []
    for _ in range(n):
        layer.weight.grad = None
        layer(x).backward(g)
        out.append(layer.weight.grad.clone())
    return torch.stack(out)


def mean_z_squared(estimates: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """Per entry z = (mean - exact) / standard error; returns (mean z^2, max |z|)."""
    se = estimates.std(0) / math.sqrt(estimates.shape[0])
    z = (estimates.mean(0) - exact) / se
    return float((z**2).mean()), float(z.abs().max())


# ----------------------------------------------------------------------------- one layer


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_weight_gradient_is_unbiased_and_the_rest_exact(kind: str, layout: str) -> None:
    """Over many seeds the mean estimate converges to the exact weight gradient.

    Unbiased: every z is ~N(0, 1), so mean z^2 ~ 1. The same check rejects a 10% bias, so it can
    fail: the bound is not vacuous.
    """
    torch.manual_seed(0)
    plain = nn.Linear(8, 6) if layout == "linear" else Conv1D(6, 8)
    x = torch.randn(4, 16, 8, requires_grad=True)
    g = torch.randn(4, 16, 6)
    y = plain(x)
    y.backward(g)
    exact_w, exact_x, exact_b = plain.weight.grad.clone(), x.grad.clone(), plain.bias.grad.clone()
    wrapper = RandomizedLinear if layout == "linear" else RandomizedConv1D
    layer = wrapper(plain, 0.25, kind, "test")
    x.grad = plain.bias.grad = None
    assert torch.equal(layer(x), y)  # forward: bit-identical
    layer(x).backward(g)
    torch.testing.assert_close(x.grad, exact_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain.bias.grad, exact_b, rtol=1e-6, atol=1e-6)
    estimates = weight_grad_estimates(layer, x, g, 2000)
    z2, zmax = mean_z_squared(estimates, exact_w)
    assert z2 < 2.0 and zmax < 5.0, (z2, zmax)
    assert mean_z_squared(estimates * 1.1, exact_w)[0] > 2.0  # power: a 10% bias is caught


def test_sketch_is_regenerated_from_the_seed_alone() -> None:
    m = torch.randn(300, 5)
    first = sketch_product(m, 40, "gaussian", 7)
    assert torch.equal(first, sketch_product(m, 40, "gaussian", 7))
    assert not torch.equal(first, sketch_product(m, 40, "gaussian", 8))


def test_blockwise_sketch_equals_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    m = torch.randn(1000, 6, dtype=torch.float64)
    whole = sketch_product(m, 50, "rademacher", 3)
    monkeypatch.setattr(randomized_linear, "_SKETCH_BLOCK", 50 * 64)  # 64 rows per block
    torch.testing.assert_close(sketch_product(m, 50, "rademacher", 3), whole)


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5])
def test_saved_bytes_are_ratio_times_input_bytes(ratio: float) -> None:
    layer = nn.Linear(48, 20)
    x = torch.randn(8, 40, 48, requires_grad=True)  # N = 320 rows
    plain, _ = saved_bytes(lambda: layer(x * 1.0), layer.parameters())
    assert plain == x.numel() * 4  # the input, in fp32
    patched_layer = RandomizedLinear(layer, ratio, "gaussian", "t")
    sketched, _ = saved_bytes(lambda: patched_layer(x * 1.0), layer.parameters())
    assert sketched == sketch_rows(320, ratio) * 48 * 4 == ratio * plain


def test_frozen_layers_save_no_input() -> None:
    layer = nn.Linear(16, 8).requires_grad_(False)
    x = torch.randn(32, 16, requires_grad=True)
    assert saved_bytes(lambda: layer(x), layer.parameters())[0] == 0  # plain F.linear
    frozen = RandomizedLinear(layer, 0.2, "gaussian", "t")
    assert saved_bytes(lambda: frozen(x), layer.parameters())[0] == 0


def test_global_rng_untouched_and_seeded_per_layer() -> None:
    plain = nn.Linear(8, 4)
    layer = RandomizedLinear(plain, 0.5, "gaussian", "0:a")
    twin = RandomizedLinear(copy.deepcopy(plain), 0.5, "gaussian", "0:a")
    x = torch.randn(64, 8)
    state = torch.get_rng_state()
    layer(x).sum().backward()
    twin(x).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(layer.weight.grad, twin.weight.grad)  # same seed string, same sketches


def test_fake_tensors_and_meta() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak(mode: Any) -> int:
        with mode:
            model = tiny_model("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            randomized_linear.apply(model, RandomizedLinearConfig(ratio=0.2))
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                model(input_ids=torch.randint(0, 512, (4, 128))).logits.sum().backward()
            return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    assert peak(FakeTensorMode()) == peak(torch.device("cpu"))  # what the estimator will see
    layer = RandomizedLinear(nn.Linear(8, 4, device="meta"), 0.2, "rademacher", "m")
    x = torch.randn(3, 50, 8, device="meta", requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad.device.type == "meta" and x.grad.shape == x.shape


# ---------------------------------------------------------------------------------- models


_BERT = ["attention.self.query", "attention.self.key", "attention.self.value",
         "attention.output.dense", "intermediate.dense", "output.dense"]
_DECODER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
BLOCK_LINEARS = {"bert": _BERT, "roberta": _BERT, "llama": _DECODER, "mistral": _DECODER,
                 "qwen2": _DECODER, "gpt2": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]}


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_model_forward_bit_identical_and_only_patched_weights_change(arch: str) -> None:
    model = tiny_model(arch)
    model.train()  # dropout on: the patch must not consume the global RNG
    ids = torch.randint(0, 512, (2, 16))
    torch.manual_seed(3)
    before = model(input_ids=ids).logits
    before.square().mean().backward()
    exact = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    randomized_linear.apply(model, RandomizedLinearConfig(ratio=0.5), seed=1)
    torch.manual_seed(3)
    after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    after.square().mean().backward()
    (record,) = patches.records(model)
    patched = {f"{m}.weight" for m in record.modules}
    # found from the structure, they are the per-architecture lists memtrain once kept by hand
    inside = {m.removeprefix(f"{b}.") for b in blocks(model) for m in record.modules
              if m.startswith(f"{b}.")}
    assert inside == set(BLOCK_LINEARS[arch])
    assert len(record.modules) == len(BLOCK_LINEARS[arch]) * 2  # 2 layers
    for name, param in model.named_parameters():
        if name in patched:
            assert not torch.equal(param.grad, exact[name])
        else:  # input gradients are exact, so every other gradient is too
            torch.testing.assert_close(param.grad, exact[name], rtol=1e-4, atol=1e-6)


def test_bert_step_saves_the_sketched_inputs() -> None:
    model = tiny_model("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 512, (4, 64))  # N = 256 rows
    vanilla, _ = saved_bytes(lambda: model(input_ids=ids).logits, model.parameters())
    randomized_linear.apply(model, RandomizedLinearConfig(ratio=0.25))
    patched, _ = saved_bytes(lambda: model(input_ids=ids).logits, model.parameters())
    h, inter, n = 64, 128, 256
    # Per layer, patching frees: the attention input (shared by q, k, v), the attention-block
    # output and the GELU output; not the context, which sdpa keeps for its own backward anyway.
    # It adds six sketches.
    full = 4 * n * (h + h + inter)
    sketches = 4 * (n // 4) * (3 * h + h + h + inter)
    assert vanilla - patched == 2 * (full - sketches)


def test_lora_model_patches_only_adapter_linears() -> None:
    """On peft's own LoRA layers (each ``lora_A`` keeps an fp32 copy of its input) the sketch saves
    memory. memtrain's lean LoRA layers keep no copy at all; a sketched ``lora_A`` falls back to
    peft's layer, so there the sketch costs more than it saves, and the planner (which traces
    both) leaves it off."""
    from peft import LoraConfig, get_peft_model

    def lora_model(lean: bool) -> nn.Module:
        torch.manual_seed(0)
        if lean:
            return lora.apply(tiny_model("llama"), AdapterConfig(r=4, dropout=0.1))
        return get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                               target_modules="all-linear"))

    ids = torch.randint(0, 512, (2, 32))
    lean_model = lora_model(True)
    lean, _ = saved_bytes(lambda: lean_model(input_ids=ids).logits, lean_model.parameters())
    model = lora_model(False)
    vanilla, _ = saved_bytes(lambda: model(input_ids=ids).logits, model.parameters())
    randomized_linear.apply(model, RandomizedLinearConfig(ratio=0.25))
    record = patches.records(model)[-1]
    assert len(record.modules) == 2 * 7  # 2 layers x 7 projections, lora_A only
    assert all(".lora_A." in n for n in record.modules)
    patched, _ = saved_bytes(lambda: model(input_ids=ids).logits, model.parameters())
    assert lean < patched < vanilla
    record.undo()
    assert not any(isinstance(m, RandomizedLinear) for m in model.modules())


def test_recipe_hook(tmp_path: Any) -> None:
    (tmp_path / "x.txt").write_text("a b c\n", encoding="utf-8")
    config = {**TINY_CONFIGS["gpt2"], "vocab_size": 512}
    rec = {"model": {"from_config": config, "tokenizer": MINILM},
           "data": {"source": str(tmp_path / "x.txt")}, "adapter": {"method": "full"},
           "memory": {"randomized_linear": {"ratio": 0.3, "sketch": "rademacher",
                                            "targets": ["mlp.c_fc"]}}}
    model = patches.apply_patches(tiny_model("gpt2"), load_recipe(rec), only=["randomized_linear"])
    (record,) = patches.records(model)
    assert record.modules == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert isinstance(model.get_submodule(record.modules[0]), RandomizedConv1D)
    assert "rademacher, ratio 0.3" in record.detail


# -------------------------------------------------------------------------------- failures


def test_pattern_matching_nothing_raises() -> None:
    with pytest.raises(NoMatchError, match=r"randomized_linear\.targets.*q_proj"):
        randomized_linear.apply(tiny_model("llama"), RandomizedLinearConfig(targets=["c_fc"]))


def test_pattern_matching_only_frozen_layers_raises() -> None:
    model = lora.apply(tiny_model("llama"), AdapterConfig(r=4))
    with pytest.raises(NoMatchError):
        randomized_linear.apply(model, RandomizedLinearConfig(targets=["*.base_layer"]))


def test_a_model_without_repeated_blocks_needs_targets() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    with pytest.raises(MemtrainError, match=r"linear\.targets`: .*no repeated blocks.*e\.g\. 0, 2"):
        randomized_linear.apply(model, RandomizedLinearConfig())
    randomized_linear.apply(model, RandomizedLinearConfig(targets=["2"]))  # explicit targets work
    assert isinstance(model[2], RandomizedLinear) and type(model[0]) is nn.Linear


def test_blocks_without_a_trainable_linear_name_the_blocks_and_real_paths() -> None:
    model = tiny_model("qwen2")
    for name, param in model.named_parameters():
        param.requires_grad_("layers" not in name)  # only the embeddings and head train
    with pytest.raises(MemtrainError, match=r"inside its repeated blocks \(model\.layers\).*e\.g\. lm_head"):
        randomized_linear.apply(model, RandomizedLinearConfig())


def test_composes_with_lora_few_bit_and_checkpointing() -> None:
    """Recompute under checkpointing draws a fresh seed and saves a matching sketch."""
    from memtrain.config import FewBitConfig
    from memtrain.patches import checkpointing, fewbit

    model = lora.apply(tiny_model("bert"), AdapterConfig(r=4), "sequence-classification")
    ids, labels = torch.randint(0, 512, (2, 16)), torch.tensor([0, 1])
    model.eval()  # no dropout: compare outputs
    before = model(input_ids=ids, labels=labels).logits
    fewbit.apply(model, FewBitConfig(bits=3))
    randomized_linear.apply(model, RandomizedLinearConfig(ratio=0.3))
    checkpointing.apply(model)
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    out = model(input_ids=ids, labels=labels)
    assert torch.equal(out.logits, before)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_each_user_pattern_must_match_lora_forms_count() -> None:
    model = lora.apply(tiny_model("llama"), AdapterConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(NoMatchError, match=r"\['self_attn\.k_proj'\]"):  # frozen: not adapted
        randomized_linear.apply(model, RandomizedLinearConfig(targets=["q_proj", "self_attn.k_proj"]))
    randomized_linear.apply(model, RandomizedLinearConfig(targets=["self_attn.q_proj", "v_proj"]))
    assert len(patches.records(model)[-1].modules) == 2 * 2
    randomized_linear.apply(model, RandomizedLinearConfig(targets=["*.lora_B.*"]))  # explicitly
    assert len(patches.records(model)[-1].modules) == 2 * 2
