"""Lean RMSNorm: bit-identical outputs, autograd's gradients within rounding, one fp32 tensor per
norm less, and the estimate equals the measured step."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_CONFIGS, causal_recipe, tiny_catalog_configs, tiny_model
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from memtrain import patches
from memtrain.config import AdapterConfig, RecipeError, load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator import real_step
from memtrain.estimator.estimate import estimate
from memtrain.estimator.setup import resolve_config
from memtrain.patches import NoMatchError, lean_norm, records
from memtrain.patches import checkpointing as ckpt
from memtrain.patches import lora as lora_patch
from memtrain.plan.search import TraceCache
from memtrain.trainer import build
from scripts.probes.memprobe import LiveBytes, probe_step

FP32 = 1e-6  # relative to the largest gradient entry: fp32 rounding in another order (measured < 5e-7)
BF16 = 2**-6  # against the fp32 reference: a few bf16 roundings (2^-9 each) of the bf16 model's math
NORMS = {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm, "olmo2": Olmo2RMSNorm, "t5": T5LayerNorm}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def _norm(kind: str, dtype: torch.dtype, trainable: bool) -> nn.Module:
    torch.manual_seed(0)
    module = NORMS[kind](96)
    with torch.no_grad():  # weights away from their init (ones; zeros for Gemma's 1 + w)
        module.weight.normal_(0.0 if kind == "gemma" else 1.0, 0.3)
    module.weight.requires_grad_(trainable)
    return module.to(dtype)


def _grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    out = module(x)
    wanted = [x] + ([module.weight] if module.weight.requires_grad else [])
    return (out, *torch.autograd.grad(out, wanted, g))


# ------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("trainable", [True, False], ids=["full-ft", "frozen-weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(NORMS))
def test_each_kind_is_bit_identical_and_its_gradients_are_autograds(kind: str, dtype: torch.dtype,
                                                                    trainable: bool) -> None:
    """150 rows in tiles of 7 (a short last tile); bf16 gradients are compared with the module's
    own run in fp32 (on the same bf16 values), where autograd's bf16 roundings differ from ours."""
    plain = _norm(kind, dtype, trainable)
    lean = lean_norm.apply(copy.deepcopy(plain), lean_norm.Config(tile=7))
    assert records(lean)[0].detail.startswith(f"lean norm: 1 {kind} RMSNorms")
    x = (torch.randn(3, 50, 96, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    g = torch.randn(3, 50, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, ref = _grads(lean, x, g), _grads(plain, x, g)
    assert got[0].dtype == ref[0].dtype and torch.equal(got[0], ref[0])  # bit for bit
    assert len(got) == len(ref) == (3 if trainable else 2)
    for name, ours, theirs in zip(("input", "weight"), got[1:], ref[1:], strict=False):
        assert ours.dtype == theirs.dtype
        if dtype == torch.float32:
            assert _rel(ours, theirs) < FP32, name
        else:
            exact = _grads(plain.float(), x.float(), g.float())[1 + (name == "weight")]
            assert _rel(ours, exact) < BF16, name
            assert _rel(ours, theirs) < 2 * BF16, name


def _batch(rows: int = 2, tokens: int = 40, vocab: int = 512) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[-1, tokens - 7:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same LoRA dropout masks in both runs
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: tuple, ref: tuple, tol: float, exact_loss: bool = True) -> None:
    if exact_loss:  # the forward is bit-identical, so the loss is
        assert torch.equal(got[0], ref[0]), (got[0], ref[0])
    else:
        torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=tol, atol=0)
    assert got[1].keys() == ref[1].keys() and ref[1]
    for name, grad in ref[1].items():
        err = _rel(got[1][name], grad)
        assert err < tol, f"{name}: relative gradient error {err:.2e}"


def _lora(model: nn.Module) -> nn.Module:
    model = lora_patch.apply(model, AdapterConfig(r=4, alpha=8, target_modules="all-linear"))
    torch.manual_seed(7)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # nonzero B, or every A gradient is zero
            nn.init.normal_(param, std=0.05)
    return model


def _gemma(**overrides: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM, GemmaConfig

    values = {k: v for k, v in TINY_CONFIGS["llama"].items() if k != "model_type"}
    config = GemmaConfig(**{**values, "vocab_size": 512, "head_dim": 16, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # Gemma's norm weights start at zero (scale 1 + w): move them
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    return model


def _model(arch: str, lora: bool, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = (_gemma() if arch == "gemma" else tiny_model(arch)).to(dtype).train()
    return _lora(model) if lora else model


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_loss_and_every_gradient_equal_the_plain_model(arch: str, lora: bool, checkpointing: str) -> None:
    base = _model(arch, lora)
    # 80 rows: 12 tiles, the last one short
    lean = lean_norm.apply(copy.deepcopy(base), lean_norm.Config(tile=7))
    reference = _loss_and_grads(ckpt.apply(base, checkpointing), _batch())
    _assert_same(_loss_and_grads(ckpt.apply(lean, checkpointing), _batch()), reference, FP32)
    if not lora:  # every norm weight (final norm included) gets its gradient
        assert sum("norm" in n for n in reference[1]) == 5


@pytest.mark.parametrize("arch", ["llama", "gemma"])
@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
def test_bf16_loss_is_identical_and_gradients_within_bf16_rounding(arch: str, lora: bool) -> None:
    base = _model(arch, lora, torch.bfloat16)
    reference = _loss_and_grads(base, _batch())
    _assert_same(_loss_and_grads(lean_norm.apply(copy.deepcopy(base)), _batch()), reference, 4 * BF16)


DECODERS = {t: c for t, c in tiny_catalog_configs().items() if t not in ("bert", "roberta", "gpt2")}


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_every_catalog_decoder_is_matched_and_unchanged(model_type: str) -> None:
    """Llama, Mistral, Qwen2, Qwen3 (with QK-norms), Gemma 2 (four norms a layer), Phi-3."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = copy.deepcopy(DECODERS[model_type])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).train()
    lean = lean_norm.apply(copy.deepcopy(base))
    norms = [n for n, m in base.named_modules() if "RMSNorm" in type(m).__name__]
    assert records(lean)[0].modules == norms and norms[-1] == "model.norm"
    batch = _batch(tokens=70)
    _assert_same(_loss_and_grads(lean, batch), _loss_and_grads(base, batch), FP32)


def test_qlora_recipe_with_every_long_context_technique(tmp_path: Path, tiny_text_file: Path) -> None:
    """4-bit base, LoRA, tiled MLP, full checkpointing, activation offload and the chunked loss
    (fed by the final norm), built from recipes through the registry, in the recipe's order."""
    def run(lean: bool) -> tuple:
        memory = {"lean_norm": lean, "tiled_mlp": True, "checkpointing": "full", "loss": "chunked",
                  "offload": {"activations": True, "min_tensor_bytes": 0}}
        cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, memory=memory,
                                        model={"dtype": "bf16", "quantization": "nf4"}))
        model = build.build_model(cfg).train()
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.manual_seed(sum(map(ord, name)))
                nn.init.normal_(param, std=0.05)
        applied = [r.name for r in records(model)]
        assert applied == ["lora", "chunked_loss", *(["lean_norm"] * lean), "tiled_mlp", "checkpointing",
                           "activation_offload"]
        return _loss_and_grads(model, _batch(vocab=30522))

    _assert_same(run(True), run(False), 4 * BF16)


# ----------------------------------------------------------------------------------- effect

TOKENS, HIDDEN = 512, 256
WIDE = {"hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
        "max_position_embeddings": TOKENS}


def _peak(model: nn.Module) -> int:
    """Peak live bytes of a forward + backward (scripts/probes/memprobe.py: no memtrain code)."""
    ids = torch.randint(0, 512, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    with LiveBytes() as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    return probe.device_peak


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_fp32_tensor_per_norm_is_gone(dtype: torch.dtype, checkpointing: str) -> None:
    """Without checkpointing every norm (2 a layer and the final one) keeps, besides its input,
    an fp32 tokens × hidden tensor (fp32 model: the normalized tensor; bf16: the fp32 copy of the
    input and the bf16 normalized one, less the input the lean norm keeps where the plain one keeps
    none); with full checkpointing one layer's recompute holds its two norms' at the peak. What
    the lean norm adds per norm is ``rstd``, one fp32 value per token."""
    base = tiny_model("llama", **WIDE).to(dtype).train()
    lean = lean_norm.apply(copy.deepcopy(base))
    saved = _peak(ckpt.apply(base, checkpointing)) - _peak(ckpt.apply(lean, checkpointing))
    norms = 5 if checkpointing == "none" else 2
    assert saved >= norms * TOKENS * (HIDDEN * 4 - 4), saved


# CI's long leg; in the suite: the bf16 saving (test_one_fp32_tensor_per_norm_is_gone) and a LoRA run
# with the lean norm counted by memprobe (tests/end_to_end/test_independent_count.py)
@pytest.mark.long
def test_estimate_equals_the_measured_step_and_an_independent_count(tmp_path: Path,
                                                                    tiny_text_file: Path) -> None:
    """bf16 full fine-tuning: each of the 5 norms keeps an fp32 copy of its input and the bf16
    normalized tensor, the lean one its bf16 input (and rstd). (Under fp32 LoRA a plain norm keeps
    no copy at all: ``x.to(float32)`` is ``x``, and a frozen weight needs no normalized tensor.)"""
    recipe = causal_recipe(tmp_path, tiny_text_file, data={"max_length": 128},
                           model={"dtype": "bf16", "from_config": {**TINY_CONFIGS["llama"], **WIDE}},
                           adapter={"method": "full"}, training={"micro_batch_size": 2},
                           memory={"lean_norm": True})
    cfg = load_recipe(recipe)
    config = resolve_config(cfg.model)[0]
    predicted = estimate(cfg, device="cpu")
    measured = real_step.measure_recipe_step(cfg, config)
    assert predicted.method == "traced all 2 layers"
    assert any(p.startswith("lean norm") for p in predicted.settings["patches"])
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.by_category == measured.peak_by_category
    torch.manual_seed(0)
    with real_step.warm_recipe_step(cfg, config) as (step, model, optimizer, batch):
        independent = probe_step(step, model, optimizer, batch)
    assert predicted.peak_bytes == independent["peak"]
    plain = estimate(load_recipe({**recipe, "memory": {"lean_norm": False}}), device="cpu")
    assert plain.peak_bytes - predicted.peak_bytes >= 5 * 2 * 128 * (HIDDEN * 4 - 4)


# ---------------------------------------------------------------------------- bookkeeping


def test_registered_after_the_adapter_and_before_checkpointing() -> None:
    order = patches.available()
    assert order.index("lora") < order.index("lean_norm") < order.index("checkpointing")
    assert patches.recipe_field("lean_norm") == "memory.lean_norm"


def test_records_undo_and_patching_twice() -> None:
    model = tiny_model("llama")
    lean_norm.apply(model)
    lean_norm.apply(model)
    assert [r.name for r in records(model)] == ["lean_norm"]
    assert records(model)[0].modules == [
        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
    assert "forward" in model.model.norm.__dict__
    lean_norm.undo(model)
    assert records(model) == [] and "forward" not in model.model.norm.__dict__


def test_inference_runs_the_modules_own_forward_and_signatures_are_kept() -> None:
    model = _lora(tiny_model("llama")).eval()
    names = [n for n, _ in model.named_modules()]
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        lean_norm.apply(model)
        assert torch.equal(model(input_ids=ids).logits, before)
    assert [n for n, _ in model.named_modules()] == names
    norm = model.get_base_model().model.norm
    assert list(inspect.signature(norm.forward).parameters) == ["hidden_states"]


def test_a_norm_with_other_math_is_not_matched() -> None:
    """A subclass whose forward differs by one cast keeps its forward (no silent other math)."""
    class Other(LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    assert lean_norm.kind_of(Other(8)) is None
    assert lean_norm.kind_of(LlamaRMSNorm(8)).name == "llama"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- failure paths


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_a_model_without_a_known_norm_is_refused_naming_the_field(arch: str) -> None:
    with pytest.raises(NoMatchError, match=r"`memory.lean_norm`: got true.*LayerNorm.*"
                                           r"Fix: set `memory.lean_norm: false`"):
        lean_norm.apply(tiny_model(arch))


def test_a_recipe_on_a_model_without_a_norm_names_the_field(tmp_path: Path, tiny_text_file: Path) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file, "gpt2", memory={"lean_norm": True})
    with pytest.raises(MemtrainError, match=r"memory.lean_norm.*Fix"):
        build.build_model(load_recipe(recipe))


def test_bad_values_are_rejected_and_auto_needs_the_planner(tmp_path: Path, tiny_text_file: Path) -> None:
    with pytest.raises(RecipeError, match=r"memory\.lean_norm"):
        load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"lean_norm": "sometimes"}))
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"lean_norm": "auto"}))
    with pytest.raises(MemtrainError, match=r"memory.lean_norm.*auto"):
        estimate(cfg, device="cpu")
    with pytest.raises(MemtrainError, match=r"tile"):
        lean_norm.apply(tiny_model("llama"), lean_norm.Config(tile=0))


# --------------------------------------------------------------------------------- planner


@pytest.mark.slow  # measures this machine's rates once (about 10 s)
def test_the_planner_chooses_it_only_when_the_budget_needs_it(tmp_path: Path, tiny_text_file: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.plan import planner

    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(tmp_path / "calibration.json"))
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, data={"max_length": 128},
                                    model={"dtype": "bf16", "from_config": {**TINY_CONFIGS["llama"], **WIDE}},
                                    adapter={"method": "full"}, training={"micro_batch_size": 2},
                                    memory={"lean_norm": "auto"}))
    peaks = {on: estimate(planner.with_values(cfg, {"memory.lean_norm": on}), device="cpu").total_bytes
             for on in (False, True)}
    assert peaks[True] < peaks[False]
    cache = TraceCache()  # the plans below share their traces (none depends on the budget)
    generous = planner.plan(cfg, int(peaks[False] / 0.9) + 1, device="cpu", cache=cache)
    assert generous.chosen.values["memory.lean_norm"] is False  # no recompute when it fits
    tight = planner.plan(cfg, int(peaks[True] / 0.9) + 1, device="cpu", cache=cache)
    assert tight.chosen.values["memory.lean_norm"] is True
    assert tight.apply(cfg).memory.lean_norm is True
