"""Tiled MLP: same loss and gradients as the untiled model, less memory, one more MLP forward."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_CONFIGS, causal_recipe, tiny_catalog_configs, tiny_model
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memtrain import patches
from memtrain.config import AdapterConfig, RecipeError, load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator import real_step
from memtrain.estimator.estimate import estimate
from memtrain.estimator.setup import resolve_config
from memtrain.patches import NoMatchError, records, tiled_mlp
from memtrain.patches import checkpointing as ckpt
from memtrain.patches import lora as lora_patch
from memtrain.plan.search import TraceCache
from memtrain.trainer import build
from scripts.probes.memprobe import LiveBytes, probe_step

FP32 = 1e-5  # relative to the largest gradient entry; summation order differs between tiles
BF16 = 2e-2  # a few bf16 roundings (2^-8 each) of the per-tile partial sums


def _batch(rows: int = 2, tokens: int = 40, vocab: int = 512) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[-1, tokens - 7:] = 0  # a padded row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same dropout masks in both runs (GPT-2 and LoRA dropout)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: tuple, ref: tuple, tol: float) -> None:
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=tol, atol=0)
    assert got[1].keys() == ref[1].keys() and ref[1]
    for name, grad in ref[1].items():
        scale = grad.float().abs().max().clamp_min(1e-12)
        err = ((got[1][name].float() - grad.float()).abs().max() / scale).item()
        assert err < tol, f"{name}: relative gradient error {err:.2e}"


def _lora(model: nn.Module, dropout: float = 0.0) -> nn.Module:
    """memtrain's LoRA on every linear layer, with nonzero B (peft starts B at zero, which would
    make every A gradient zero and the comparison empty)."""
    model = lora_patch.apply(model, AdapterConfig(r=4, alpha=8, dropout=dropout, target_modules="all-linear"))
    torch.manual_seed(7)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.05)
    return model


def _model(arch: str, lora: bool, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = tiny_model(arch).to(dtype).train()
    return _lora(model) if lora else model


# ------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gated MLP; two-layer with its dropout on
def test_loss_and_every_gradient_equal_the_untiled_model(arch: str, lora: bool, checkpointing: str) -> None:
    base = _model(arch, lora)
    tiled = tiled_mlp.apply(copy.deepcopy(base), 3)  # 80 rows in 3 tiles: the last one is short
    batch = _batch()
    reference = _loss_and_grads(ckpt.apply(base, checkpointing), batch)  # in the recipe's order
    _assert_same(_loss_and_grads(ckpt.apply(tiled, checkpointing), batch), reference, FP32)
    if lora:  # gradients reach LoRA A and B inside the MLP, and no frozen weight
        mlp_grads = [n for n in reference[1] if ".mlp." in n]
        assert any("lora_A" in n for n in mlp_grads) and any("lora_B" in n for n in mlp_grads)
        assert all("lora_" in n for n in reference[1])


DECODERS = {t: c for t, c in tiny_catalog_configs().items() if t not in ("bert", "roberta")}


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_every_catalog_decoder_with_the_default_tile_rule(model_type: str) -> None:
    """Qwen3, Gemma 2 (GELU-tanh, soft-capping) and Phi-3 (fused gate and up projection) too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = copy.deepcopy(DECODERS[model_type])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).train()
    batch = _batch(tokens=70)  # 140 rows / hidden 64: 3 tiles by ALST's rule
    reference = _loss_and_grads(base, batch)
    _assert_same(_loss_and_grads(tiled_mlp.apply(copy.deepcopy(base)), batch), reference, FP32)


@pytest.mark.parametrize("lora", [False, True], ids=["full-ft", "lora"])
def test_bf16_equals_the_untiled_model_within_bf16_rounding(lora: bool) -> None:
    base = _model("llama", lora, torch.bfloat16)
    batch = _batch()
    reference = _loss_and_grads(base, batch)
    _assert_same(_loss_and_grads(tiled_mlp.apply(copy.deepcopy(base), 4), batch), reference, BF16)


def test_lora_dropout_masks_are_replayed_in_backward() -> None:
    """With one tile the random draws are the untiled model's: only a replayed generator state
    gives backward the masks forward used (several tiles draw other, equally valid, masks)."""
    base = _lora(tiny_model("llama").train(), dropout=0.3)
    batch = _batch()
    reference = _loss_and_grads(base, batch)
    _assert_same(_loss_and_grads(tiled_mlp.apply(copy.deepcopy(base), 1), batch), reference, FP32)


def test_backward_recomputes_under_the_forwards_autocast() -> None:
    """With one tile the bf16 autocast matmuls are the untiled ones, bit for bit, only when the
    recompute runs under the same autocast state (outside it, it would recompute in fp32)."""
    def run(model: nn.Module) -> tuple:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # backward outside, as the Trainer runs it
            loss = model(**_batch()).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    base = tiny_model("llama").train()
    _assert_same(run(tiled_mlp.apply(copy.deepcopy(base), 1)), run(base), FP32)


def test_qlora_4bit_recipe_trains_the_same_gradients(tmp_path: Path, tiny_text_file: Path) -> None:
    """bitsandbytes 4-bit base layers inside the tiles, built from a recipe through the registry."""
    def grads(tiled: bool) -> tuple:
        quantized = {"dtype": "bf16", "quantization": "nf4"}
        cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, model=quantized,
                                        memory={"tiled_mlp": tiled, "tiled_mlp_tiles": 3}))
        model = build.build_model(cfg).train()
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.manual_seed(sum(map(ord, name)))
                nn.init.normal_(param, std=0.05)
        assert any(r.name == "tiled_mlp" for r in records(model)) == tiled
        return _loss_and_grads(model, _batch())

    _assert_same(grads(True), grads(False), BF16)


def test_composes_with_checkpointing_and_activation_offload_in_the_recipe_order(
        tmp_path: Path, tiny_text_file: Path) -> None:
    def grads(tiled: bool) -> tuple:
        memory = {"tiled_mlp": tiled, "checkpointing": "full",
                  "offload": {"activations": True, "min_tensor_bytes": 0}}
        model = build.build_model(load_recipe(causal_recipe(tmp_path, tiny_text_file, memory=memory))).train()
        torch.manual_seed(5)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.05)
        applied = [r.name for r in records(model)]
        assert applied == ["lora", *(["tiled_mlp"] * tiled), "checkpointing", "activation_offload"]
        return _loss_and_grads(model, _batch(vocab=30522))

    _assert_same(grads(True), grads(False), FP32)


def test_gradient_hooks_fire_once_per_parameter() -> None:
    """Gradients summed over tiles reach each parameter once (the optimizer step inside backward
    steps in these hooks), not once per tile as with a per-tile ``backward``."""
    model = tiled_mlp.apply(tiny_model("llama").train(), 4)
    calls: dict[str, int] = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, n=name: calls.update({n: calls.get(n, 0) + 1}))
    model(**_batch()).loss.backward()
    assert len(calls) == len(list(model.parameters())) and set(calls.values()) == {1}


# ----------------------------------------------------------------------------------- effect

WIDE = {"hidden_size": 64, "intermediate_size": 1024, "num_hidden_layers": 2}
TOKENS = 256


def _peak_and_flops(model: nn.Module) -> tuple[int, int]:
    """Peak live bytes of a forward + backward (scripts/probes/memprobe.py, no memtrain code) and its
    FLOPs."""
    ids = torch.randint(0, 512, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    with LiveBytes() as probe, FlopCounterMode(display=False) as flops:
        model(input_ids=ids, labels=ids).loss.backward()
    return probe.device_peak, flops.get_total_flops()


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_the_intermediate_is_gone_and_one_mlp_forward_is_added(checkpointing: str) -> None:
    """Without checkpointing each layer keeps gate, up, activation and product (4 × tokens ×
    intermediate) for backward; with checkpointing one layer's recompute still holds them; tiled,
    one tile's do. Backward gains exactly one MLP forward: 3 matmuls of 2 × hidden × intermediate
    FLOPs per token and layer; under full checkpointing also the down projection, which the
    layer's recompute otherwise skips (torch's early stop: nothing after it is saved); under
    selective checkpointing a second MLP forward, the layer's recompute of the tiles (selective
    keeps matmul outputs, which here would be every tile's intermediate)."""
    base = tiny_model("llama", **WIDE).train()
    tiled = tiled_mlp.apply(copy.deepcopy(base), 8)
    plain_peak, plain_flops = _peak_and_flops(ckpt.apply(base, checkpointing))
    tiled_peak, tiled_flops = _peak_and_flops(ckpt.apply(tiled, checkpointing))
    intermediate = TOKENS * 1024 * 4  # bytes of one fp32 tokens × intermediate tensor
    layers = 1 if checkpointing == "full" else 2
    assert plain_peak - tiled_peak > 3 * layers * intermediate, (plain_peak, tiled_peak)
    matmuls = {"none": 3, "full": 4, "selective": 6}[checkpointing]
    assert tiled_flops - plain_flops == 2 * 2 * TOKENS * matmuls * 64 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_gradients_match_with_lora_dropout_and_the_allocator_peak_drops() -> None:
    """CUDA's generator state is replayed too (one tile: the untiled masks); the allocator's own
    peak drops by more than the saved intermediates of both layers."""
    base = _lora(tiny_model("llama", **WIDE).to("cuda", torch.bfloat16).train(), dropout=0.2)
    batch = {k: v.cuda() for k, v in _batch().items()}
    reference = _loss_and_grads(base, batch)
    _assert_same(_loss_and_grads(tiled_mlp.apply(copy.deepcopy(base), 1), batch), reference, BF16)

    def peak(model: nn.Module) -> int:
        ids = torch.randint(0, 512, (1, TOKENS), device="cuda")
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    plain = tiny_model("llama", **WIDE).to("cuda", torch.bfloat16).train()
    plain_peak = peak(plain)
    assert plain_peak - peak(tiled_mlp.apply(plain, 8)) > 3 * 2 * TOKENS * 1024 * 2


def test_estimate_equals_the_measured_step_and_an_independent_count(tmp_path: Path,
                                                                    tiny_text_file: Path) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file, data={"max_length": 128},
                           model={"from_config": {**TINY_CONFIGS["llama"], **WIDE}},
                           training={"micro_batch_size": 2}, memory={"tiled_mlp": True})
    cfg = load_recipe(recipe)
    config = resolve_config(cfg.model)[0]
    predicted = estimate(cfg, device="cpu")
    measured = real_step.measure_recipe_step(cfg, config)
    assert predicted.method == "traced all 2 layers"
    assert any(p.startswith("tiled MLP") for p in predicted.settings["patches"])
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.by_category == measured.peak_by_category
    torch.manual_seed(0)
    with real_step.warm_recipe_step(cfg, config) as (step, model, optimizer, batch):
        independent = probe_step(step, model, optimizer, batch)
    assert predicted.peak_bytes == independent["peak"]
    untiled = estimate(load_recipe({**recipe, "memory": {"tiled_mlp": False}}), device="cpu")
    assert untiled.peak_bytes - predicted.peak_bytes > 3 * 2 * 2 * 128 * 1024 * 4


def test_default_tiles_are_full_so_the_largest_never_shrinks() -> None:
    hidden = 64
    largest = [max(b - a for a, b in tiled_mlp._spans(n, tiled_mlp.tile_size(n, hidden)))
               for n in range(1, 5 * hidden)]
    assert largest == sorted(largest) and max(largest) == hidden
    spans = tiled_mlp._spans(200, tiled_mlp.tile_size(200, hidden))
    assert len(spans) == tiled_mlp.default_tiles(200, hidden)
    assert tiled_mlp._spans(10, tiled_mlp.tile_size(10, hidden, tiles=3)) == [(0, 4), (4, 8), (8, 10)]


def test_the_estimate_grows_with_the_length_past_each_multiple_of_hidden(tmp_path: Path,
                                                                         tiny_text_file: Path) -> None:
    """With ALST's equal tiles the estimate dropped just past a multiple of the hidden size (the
    tile halves), and the longest-length search saw 3,840 tokens fail where 5,888 fitted."""
    peaks = []
    for length in (48, 64, 72, 96, 128, 136):
        recipe = causal_recipe(tmp_path, tiny_text_file, data={"max_length": length},
                               model={"from_config": {**TINY_CONFIGS["llama"], **WIDE,
                                                      "intermediate_size": 32768}},  # the MLP's peak
                               training={"micro_batch_size": 1},
                               memory={"tiled_mlp": True, "checkpointing": "full"})
        peaks.append(estimate(load_recipe(recipe), device="cpu").peak_bytes)
    assert peaks == sorted(peaks), peaks


# ---------------------------------------------------------------------------- bookkeeping


def test_registered_between_the_approximate_layers_and_checkpointing() -> None:
    order = patches.available()
    assert order.index("lora") < order.index("tiled_mlp") < order.index("checkpointing")
    assert order.index("fewbit") < order.index("tiled_mlp")


def test_records_names_undo_and_patching_twice() -> None:
    model = tiny_model("llama")
    tiled_mlp.apply(model, 2)
    tiled_mlp.apply(model, 2)
    assert [r.name for r in records(model)] == ["tiled_mlp"]
    assert records(model)[0].modules == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "forward" in model.model.layers[0].mlp.__dict__
    tiled_mlp.undo(model)
    assert records(model) == [] and "forward" not in model.model.layers[0].mlp.__dict__


def test_eval_and_no_grad_run_the_mlps_own_forward() -> None:
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        tiled_mlp.apply(model, 3)
        assert torch.equal(model(input_ids=ids).logits, before)


def test_lora_module_names_and_signature_are_kept() -> None:
    import inspect

    model = _lora(tiny_model("llama"))
    names = [n for n, _ in model.named_modules()]
    tiled_mlp.apply(model)
    assert [n for n, _ in model.named_modules()] == names
    mlp = model.get_base_model().model.layers[0].mlp
    assert list(inspect.signature(mlp.forward).parameters) == ["x"]


# ---------------------------------------------------------------------------- failure paths


@pytest.mark.parametrize("arch", ["bert", "mixtral"])
def test_a_model_without_an_mlp_to_tile_is_refused_naming_the_field(arch: str) -> None:
    """BERT's feed-forward is two modules (intermediate, output); Mixtral's experts are fused."""
    if arch == "mixtral":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      vocab_size=512)
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = tiny_model(arch)
    with pytest.raises(NoMatchError, match=r"`memory.tiled_mlp`: got true.*Fix: set `memory.tiled_mlp: fal"):
        tiled_mlp.apply(model)


def test_a_recipe_on_a_model_without_an_mlp_names_the_field(tmp_path: Path,
                                                            tiny_classification_file: Path) -> None:
    recipe = causal_recipe(tmp_path, tiny_classification_file, "bert", memory={"tiled_mlp": True},
                           model={"task": "sequence-classification"}, data={"format": "classification"})
    with pytest.raises(MemtrainError, match=r"memory.tiled_mlp.*Fix"):
        build.build_model(load_recipe(recipe), num_labels=2)


@pytest.mark.parametrize("tiles", [0, -3, 2.5, "many"])
def test_bad_tile_counts_are_rejected_by_the_schema(tiles: Any, tmp_path: Path, tiny_text_file: Path) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file, memory={"tiled_mlp": True, "tiled_mlp_tiles": tiles})
    with pytest.raises(RecipeError, match=r"memory\.tiled_mlp_tiles"):
        load_recipe(recipe)
    with pytest.raises(MemtrainError, match=r"memory.tiled_mlp_tiles.*Fix"):
        tiled_mlp.apply(tiny_model("llama"), tiles)


def test_bad_switch_values_are_rejected_and_auto_needs_the_planner(tmp_path: Path,
                                                                   tiny_text_file: Path) -> None:
    with pytest.raises(RecipeError, match=r"memory\.tiled_mlp"):
        load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"tiled_mlp": "sometimes"}))
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"tiled_mlp": "auto"}))
    with pytest.raises(MemtrainError, match=r"memory.tiled_mlp.*auto"):
        estimate(cfg, device="cpu")


# --------------------------------------------------------------------------------- planner


@pytest.mark.slow  # measures this machine's rates once (about 10 s)
def test_the_planner_tiles_only_when_the_budget_needs_it(tmp_path: Path, tiny_text_file: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.plan import planner

    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(tmp_path / "calibration.json"))
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, data={"max_length": 128},
                                    model={"from_config": {**TINY_CONFIGS["llama"], **WIDE}},
                                    training={"micro_batch_size": 2}, memory={"tiled_mlp": "auto"}))
    peaks = {on: estimate(planner.with_values(cfg, {"memory.tiled_mlp": on}), device="cpu").total_bytes
             for on in (False, True)}
    assert peaks[True] < peaks[False]
    cache = TraceCache()  # the plans below share their traces (none depends on the budget)
    generous = planner.plan(cfg, int(peaks[False] / 0.9) + 1, device="cpu", cache=cache)
    assert generous.chosen.values["memory.tiled_mlp"] is False  # no recompute when it fits
    tight = planner.plan(cfg, int(peaks[True] / 0.9) + 1, device="cpu", cache=cache)
    assert tight.chosen.values["memory.tiled_mlp"] is True
    assert tight.apply(cfg).memory.tiled_mlp is True


# ------------------------------------------------------------------- tile size from the budget


def test_tile_tokens_set_the_tile_size_and_keep_the_gradients() -> None:
    torch.manual_seed(0)
    plain = tiny_model("llama", **WIDE).train()
    x = torch.randint(0, 100, (2, 40))
    reference = _loss_and_all_grads(plain, x)
    patched = tiled_mlp.apply(copy.deepcopy(plain), tokens=16)
    assert "tiles of 16 tokens" in records(patched)[0].detail
    got = _loss_and_all_grads(patched, x)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
    spans = tiled_mlp._spans(80, tiled_mlp.tile_size(80, 64, tokens=16))
    assert spans == [(i, i + 16) for i in range(0, 80, 16)]


def _loss_and_all_grads(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize(("memory", "message"), [
    ({"tiled_mlp": True, "tiled_mlp_tile_tokens": 0}, "at least 1"),
    ({"tiled_mlp": True, "tiled_mlp_tile_tokens": 64, "tiled_mlp_tiles": 4}, "sized twice"),
    ({"tiled_mlp": False, "tiled_mlp_tile_tokens": 64}, "the tiled MLP is off"),
])
def test_conflicting_or_bad_tile_sizes_name_the_field(memory: dict, message: str, tmp_path: Path,
                                                     tiny_text_file: Path) -> None:
    with pytest.raises(RecipeError, match=rf"memory\.tiled_mlp_tile_tokens.*{message}.*Fix"):
        load_recipe(causal_recipe(tmp_path, tiny_text_file, memory=memory))


def test_the_planner_sizes_tiles_from_the_budget(tmp_path: Path, tiny_text_file: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`memory.tiled_mlp_tile_tokens: auto`: hidden_size tokens when that fits (fewer, larger
    tiles are faster), a quarter or a sixteenth of it when only they fit."""
    from memtrain.plan import planner, space

    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(tmp_path / "calibration.json"))
    shape = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 1,
             "intermediate_size": 8192,  # one 512-token tile's intermediate: 16 MiB per fp32 copy
             "max_position_embeddings": 512}  # the tiny Llama has 256 positions; 512-token rows here
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, data={"max_length": 512},
                                    model={"from_config": {**TINY_CONFIGS["llama"], **shape}},
                                    training={"micro_batch_size": 2},
                                    memory={"tiled_mlp": True, "tiled_mlp_tile_tokens": "auto",
                                            "checkpointing": "full", "loss": "chunked"}))
    assert space.ladder(cfg, "memory.tiled_mlp_tile_tokens") == [None, 128, 32]  # None: hidden_size
    totals = {size: estimate(planner.with_values(cfg, {"memory.tiled_mlp_tile_tokens": size}),
                             device="cpu").total_bytes for size in (None, 128, 32)}
    assert totals[None] - totals[128] > 8 * 2**20 and totals[128] >= totals[32]
    cache = TraceCache()  # the plans below share their traces (none depends on the budget)
    roomy = planner.plan(cfg, int(totals[None] / 0.9) + 1, device="cpu", cache=cache)
    assert roomy.chosen.values["memory.tiled_mlp_tile_tokens"] is None
    tight = planner.plan(cfg, int(totals[128] / 0.9) + 1, device="cpu", cache=cache)
    assert tight.chosen.values["memory.tiled_mlp_tile_tokens"] == 128
    assert tight.apply(cfg).memory.tiled_mlp_tile_tokens == 128


def test_smaller_4bit_tiles_are_predicted_slower() -> None:
    """Each tile dequantizes the 4-bit MLP weights again, in forward, recompute and backward."""
    from memtrain.plan import costmodel

    rates = costmodel.Rates("test", {"matmul_flops": {"bf16": 1e14}, "memory_bandwidth": 1e12,
                                     "op_seconds": 1e-5, "dequantize_nf4_elements": 1e11,
                                     "optimizer_seconds_per_parameter": {"adamw": 1e-11},
                                     "host_to_device_bandwidth": 1e10, "device_to_host_bandwidth": 1e10})
    work = costmodel.Work(1, 1e12, 1000, 1e9, 10)
    costs = [costmodel.step_seconds(work, micro_batches=1, rates=rates, dtype="bf16", optimizer="adamw",
                                    trainable=0, quantized_elements=10**9, extra_dequantized=extra).seconds
             for extra in (0, 10**10)]
    assert costs[1] - costs[0] == pytest.approx(0.1)


def test_the_extra_dequantization_counts_every_tile_of_every_pass() -> None:
    from memtrain.patches.tiled_mlp import tiled_dequantized

    weights = 32 * 3 * 4096 * 14336
    # one tile: forward, recompute, backward's recompute and backward, against the untiled 3 passes
    assert tiled_dequantized(weights, 4096, 4096, None, None, 1.0) == weights * 1
    assert tiled_dequantized(weights, 4096, 4096, None, 1024, 1.0) == weights * (4 * 4 - 3)
    assert tiled_dequantized(weights, 4096, 4096, 2, 1024, 0.0) == weights * (2 * 3 - 2)  # a count wins


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-attention", "sequential"])
def test_an_mlp_output_changed_in_place_by_the_model_trains_as_untiled(parallel: bool) -> None:
    """Falcon adds the attention output to its MLP's output in place (``mlp_output +=``): the tiled
    MLP returns a tensor of its own, not a view from inside its autograd Function, which autograd
    forbids changing in place. (Planted: the output returned as a view of the tiles' buffer ->
    RuntimeError "Output 0 of _TiledMLP is a view and is being modified inplace".)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=512, new_decoder_architecture=parallel, num_kv_heads=2,
                                  parallel_attn=parallel)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).train()
    batch = _batch()
    reference = _loss_and_grads(base, batch)
    _assert_same(_loss_and_grads(tiled_mlp.apply(copy.deepcopy(base), 3), batch), reference, FP32)
