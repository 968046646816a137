"""The estimator: fake trace == real step, extrapolation == full trace, quantized bytes, errors."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MINILM, TINY_CONFIGS, causal_recipe, merge
from transformers import TrainingArguments

from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator import real_step
from memtrain.estimator.estimate import estimate, sweep
from memtrain.estimator.setup import resolve_config
from memtrain.model import model_class, model_kwargs
from memtrain.trainer import build

ROOT = Path(__file__).resolve().parents[2]
GEMMA2 = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 30522,
          "sliding_window": 16, "max_position_embeddings": 256}
# A mixture of experts: transformers runs its experts through torch's grouped matmul, whose meta
# kernel accepts only bf16 (memtrain.estimator.fake lets a float32 trace through).
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 30522, "max_position_embeddings": 256}
OTHER_ARCHS = {"gemma2": GEMMA2, "mixtral": MIXTRAL}


def recipe(tmp_path: Path, data_file: Path, arch: str = "llama", depth: int | None = None,
           **sections: Any) -> dict:
    """A tiny recipe; ``depth`` sets the number of decoder layers."""
    out = causal_recipe(tmp_path, data_file, "llama" if arch in OTHER_ARCHS else arch, **sections)
    if arch in OTHER_ARCHS:
        out["model"]["from_config"] = copy.deepcopy(OTHER_ARCHS[arch])
    if depth is not None:
        out["model"]["from_config"]["n_layer" if arch == "gpt2" else "num_hidden_layers"] = depth
    return out


CLASSIFY = {"model": {"task": "sequence-classification"}, "data": {"format": "classification"}}
CASES = {
    "llama-full-fp32-adamw": ("llama", {"adapter": {"method": "full"}}),
    "llama-lora-bf16": ("llama", {"model": {"dtype": "bf16"}}),
    "llama-qlora-nf4-checkpointing": ("llama", {"model": {"dtype": "bf16", "quantization": "nf4"},
                                               "memory": {"checkpointing": "full"}}),
    "gpt2-full-adamw8bit": ("gpt2", {"adapter": {"method": "full"}, "training": {"optimizer": "adamw_8bit"}}),
    "bert-lora-classification": ("bert", CLASSIFY),
    "llama-qlora-accumulation-4": ("llama", {"model": {"dtype": "bf16", "quantization": "nf4"},
                                             "memory": {"checkpointing": "full"},
                                             "training": {"gradient_accumulation": 4}}),  # 2 traced
    "mixtral-full-fp32": ("mixtral", {"adapter": {"method": "full"}}),
    # the adapter's matmuls in bf16 (adapter.compute_dtype: model), its dropout recomputed
    "llama-lora-bf16-model-dtype": ("llama", {"model": {"dtype": "bf16"},
                                              "adapter": {"compute_dtype": "model", "dropout": 0.1}}),
    "llama-qlora-model-dtype": ("llama", {"model": {"dtype": "bf16", "quantization": "nf4"},
                                          "adapter": {"compute_dtype": "model", "dropout": 0.0},
                                          "memory": {"checkpointing": "full"}}),
    "llama-offload-activations": ("llama", {"memory": {
        "checkpointing": "full", "offload": {"activations": True, "min_tensor_bytes": 0}}}),
}


SLOW_CASES = {"llama-lora-bf16", "gpt2-full-adamw8bit", "llama-qlora-checkpointing", "mistral-accumulation-3",
              "gemma2-lora", "llama-selective-checkpointing", "llama-qlora-accumulation-4"}


def _params(cases: dict) -> list:
    """Case names; the costlier half runs with the slow tests (the suite must stay quick)."""
    return [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in cases]


@pytest.mark.parametrize("case", _params(CASES))
def test_estimate_equals_the_measured_step(case: str, tmp_path: Path, tiny_text_file: Path) -> None:
    arch, sections = CASES[case]
    cfg = load_recipe(recipe(tmp_path, tiny_text_file, arch, **sections))
    predicted = estimate(cfg, device="cpu")
    measured = real_step.measure_recipe_step(cfg, resolve_config(cfg.model)[0])
    assert predicted.method == "traced all 2 layers"
    assert predicted.peak_bytes == measured.peak_bytes  # exact: same code, fake tensors
    assert predicted.by_category == measured.peak_by_category
    assert predicted.by_phase == measured.peak_by_phase
    assert predicted.host_peak_bytes == measured.host_peak_bytes  # offloaded bytes: a separate line
    if "offload" in case:
        assert predicted.host_peak_bytes > 0


EXTRAPOLATION = {
    "llama-qlora-checkpointing": ("llama", {"model": {"dtype": "bf16", "quantization": "nf4"},
                                           "memory": {"checkpointing": "full"}}),
    "gpt2-full-8bit-cuda": ("gpt2", {"adapter": {"method": "full"}, "training": {"optimizer": "adamw_8bit"}}),
    "mistral-accumulation-3": ("mistral", {"training": {"gradient_accumulation": 3}}),
    "llama-selective-checkpointing": ("llama", {"memory": {"checkpointing": "selective"}}),
    "mixtral-lora": ("mixtral", {}),
}


@pytest.mark.parametrize("case", _params(EXTRAPOLATION))
def test_depth_extrapolation_equals_the_full_trace(case: str, tmp_path: Path, tiny_text_file: Path) -> None:
    arch, sections = EXTRAPOLATION[case]
    cfg = load_recipe(recipe(tmp_path, tiny_text_file, arch, depth=7, **sections))
    fast = estimate(cfg, device="cuda")  # CUDA target: foreach optimizer and rounding lines too
    full = estimate(cfg, device="cuda", exact=True)
    assert fast.method == "traced 2 and 3 of 7 layers, extrapolated"
    assert full.method == "traced all 7 layers"
    assert fast.peak_bytes == full.peak_bytes
    assert fast.by_category == full.by_category
    assert (fast.parameters, fast.trainable) == (full.parameters, full.trainable)
    # The CUDA lines on top of the tensors, compared only once they are there: the allocator's
    # rounding comes from the extrapolated traces, and fragmentation from the peak and what is
    # resident, so these differ where the extrapolation of a column other than the peak is wrong.
    assert set(full.overheads) == {"cuda_context", "cuda_workspaces", "allocator_rounding",
                                   "fragmentation"}, full.overheads
    assert full.overheads["allocator_rounding"] > 0 and full.overheads["fragmentation"] > 0
    assert fast.overheads == full.overheads
    assert fast.overhead_sources == full.overhead_sources
    assert (fast.total_bytes, fast.host_peak_bytes) == (full.total_bytes, full.host_peak_bytes)
    assert fast.by_phase == full.by_phase  # models of several layer kinds: test_layer_patterns.py


@pytest.mark.slow
def test_micro_batch_sweep_equals_direct_traces(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = load_recipe(recipe(tmp_path, tiny_text_file, "qwen2", adapter={"method": "full"},
                             training={"micro_batch_size": 3}))
    curves = sweep(cfg, device="cpu", micro_batch_sizes=[1, 2, 5, 8], seq_lens=[16, 32])
    for size, peak, total in curves.micro_batch_size:  # sizes 1 and 2 traced, 5 and 8 extrapolated
        data = recipe(tmp_path, tiny_text_file, "qwen2", adapter={"method": "full"},
                      training={"micro_batch_size": size})
        direct = estimate(load_recipe(data), device="cpu")
        assert (peak, total) == (direct.peak_bytes, direct.total_bytes)
    lengths = [p[0] for p in curves.seq_len]
    peaks = [p[1] for p in curves.seq_len]
    assert lengths == [16, 32] and peaks[1] > peaks[0]


# ----------------------------------------------------------------------------- quantization


def _expected_4bit(n: int, double_quant: bool) -> int:
    """Bytes bitsandbytes stores for an n-element 4-bit weight (blocksize 64), per layer."""
    blocks = -(-n // 64)
    packed, code = -(-n // 2), 16 * 4
    if not double_quant:
        return packed + blocks * 4 + code
    nested_blocks = -(-blocks // 256)
    # uint8 absmax, nested float32 absmax, float32 offset, and the 256-entry dynamic code book
    # (one tensor shared by all layers, counted here with each)
    return packed + blocks + nested_blocks * 4 + 4 + code + 256 * 4


@pytest.mark.parametrize("quant,double_quant",
                         [("nf4", True), ("nf4", False), ("fp4", True), ("int8", False)])
def test_quantized_weights_hold_what_bitsandbytes_stores(quant: str, double_quant: bool, tmp_path: Path,
                                                         tiny_text_file: Path) -> None:
    import bitsandbytes as bnb

    from memtrain.estimator.fake import fake_tensor_mode
    from memtrain.memory.quantized import quantization_state_tensors
    from memtrain.model import load_model

    cfg = load_recipe(recipe(tmp_path, tiny_text_file, adapter={"method": "lora"},
                             model={"quantization": quant, "double_quant": double_quant, "dtype": "bf16"}))
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)

    def layer_bytes(model: torch.nn.Module) -> dict[str, int]:
        out = {}
        for name, module in model.named_modules():
            if isinstance(module, kinds):
                tensors = [module.weight, *quantization_state_tensors(module)]
                out[name] = sum(t.untyped_storage().nbytes() for t in tensors)
        return out

    real = layer_bytes(load_model(cfg.model))
    with fake_tensor_mode():
        from memtrain.memory.quantized import quantize_fake

        config, _ = resolve_config(cfg.model)
        skeleton = model_class(cfg.model).from_config(config, **model_kwargs(cfg.model))
        fake = layer_bytes(quantize_fake(skeleton, cfg.model))
    assert real and fake == real
    q_proj = TINY_CONFIGS["llama"]["hidden_size"] ** 2
    expected = q_proj + 64 * 4 if quant == "int8" else _expected_4bit(q_proj, double_quant)
    assert real["model.layers.0.self_attn.q_proj"] == expected


def test_8bit_adamw_state_is_uint8_with_block_scales(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = load_recipe(recipe(tmp_path, tiny_text_file, adapter={"method": "full"},
                             training={"optimizer": "adamw_8bit"}))
    predicted = estimate(cfg, device="cpu")
    model = build.build_model(cfg)
    expected = 0
    for name, param in model.named_parameters():
        n = param.numel()
        # The Trainer keeps embeddings in 32-bit state; bitsandbytes does so below 4096 elements.
        if "embed" in name or n < 4096:
            expected += 2 * 4 * n
        else:
            expected += 2 * n + 2 * 4 * -(-n // 256)
    qmaps = 2 * 256 * 4  # the signed and unsigned dynamic code books, shared by all parameters
    assert predicted.category_at_phase_peak["optimizer"]["optimizer_state"] == expected + qmaps


# ------------------------------------------------------------------------------- overheads


def test_cuda_estimate_has_named_overhead_lines(tmp_path: Path, tiny_text_file: Path, monkeypatch) -> None:
    cfg = load_recipe(recipe(tmp_path, tiny_text_file))
    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(tmp_path / "missing.json"))
    default = estimate(cfg, device="cuda")
    assert set(default.overheads) == {"cuda_context", "cuda_workspaces", "allocator_rounding",
                                      "fragmentation"}
    assert default.overheads["cuda_context"] == 764 * 2**20  # measured on an H100 (docs/bench/gpu.md)
    assert default.overheads["cuda_workspaces"] == 64 * 2**20  # 2 x 32 MiB, as the H100 showed
    assert 0 < default.overheads["allocator_rounding"] < 0.05 * default.peak_bytes
    assert default.total_bytes == default.peak_bytes + sum(default.overheads.values())
    profile = tmp_path / "calibration.json"
    profile.write_text(json.dumps({"overheads": {"device": "Test GPU", "cuda_context_bytes": 300 * 2**20,
                                                 "cuda_workspace_bytes": 16 * 2**20, "fragmentation": 0.2,
                                                 "allocator": "expandable_segments:True"}}))
    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(profile))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    calibrated = estimate(cfg, device="cuda")
    assert calibrated.overheads["cuda_context"] == 300 * 2**20
    assert calibrated.overheads["cuda_workspaces"] == 16 * 2**20
    assert "run `memtrain calibrate` on the GPU again" not in calibrated.overhead_sources["fragmentation"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's own settings
    assert "measured on Test GPU (" in estimate(cfg, device="cuda").overhead_sources["fragmentation"]
    assert "under expandable_segments:True, while this run uses max_split_size_mb:512" in estimate(
        cfg, device="cuda").overhead_sources["fragmentation"]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert "Test GPU" in calibrated.overhead_sources["cuda_context"]
    resident = sum(calibrated.by_category.get(name, 0)
                   for name in ("parameters", "buffers", "optimizer_state"))
    transient = calibrated.peak_bytes - resident + calibrated.overheads["allocator_rounding"]
    assert 0 < resident < calibrated.peak_bytes
    assert calibrated.overheads["fragmentation"] == int(0.2 * transient)
    assert estimate(cfg, device="cpu").overheads == {}


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("change,field", [
    ({"model": {"from_config": None, "name": "acme/NoSuchModel-7B"}}, "model.name"),
    ({"training": {"micro_batch_size": "auto"}}, "training.micro_batch_size"),
    ({"adapter": {"target_modules": ["no_such_proj"]}}, "adapter.target_modules"),
    ({"memory": {"checkpointing": 5}}, "memory.checkpointing"),  # the model has 2 layers
    ({"data": {"max_length": 512}}, "data.max_length"),
])
def test_bad_input_names_the_field(change: dict, field: str, tmp_path: Path, tiny_text_file: Path) -> None:
    data = merge(recipe(tmp_path, tiny_text_file, "gpt2"), change)  # GPT-2 has 256 learned positions
    if data["model"].get("name"):
        data["model"].pop("from_config")
    with pytest.raises(MemtrainError) as err:
        estimate(load_recipe(data), device="cpu")
    assert f"`{field}`" in str(err.value)
    if field == "model.name":
        assert "meta-llama/Llama-3.1-70B" in str(err.value)  # lists what the catalog has


def test_catalog_model_needs_no_network_or_weights(tmp_path: Path, tiny_text_file: Path) -> None:
    data = recipe(tmp_path, tiny_text_file, data={"max_length": 16})
    data["model"] = {"name": "openai-community/gpt2", "tokenizer": MINILM}
    result = estimate(load_recipe(data), device="cpu")
    assert result.model == "openai-community/gpt2"
    assert result.parameters == 124_439_808 + result.trainable  # GPT-2 small plus the LoRA adapter
    assert result.method == "traced 2 and 3 of 12 layers, extrapolated"


# ------------------------------------------------------------------------------------- CLI


def test_cli_estimate_prints_json_and_tables(tmp_path: Path, tiny_text_file: Path) -> None:
    import yaml
    from typer.testing import CliRunner

    from memtrain.cli.app import app

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path, tiny_text_file)))
    result = CliRunner().invoke(app, ["estimate", str(path), "training.micro_batch_size=2", "--json",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["settings"]["micro_batch_size"] == 2
    assert out["peak_bytes"] == sum(out["by_category"].values())
    table = CliRunner().invoke(app, ["estimate", str(path), "--device", "cuda"])
    assert table.exit_code == 0 and "cuda_context" in table.output and "fragmentation" in table.output
    bad = CliRunner().invoke(app, ["estimate", str(path), "training.optimizer=auto"])
    assert bad.exit_code == 2 and "training.optimizer" in bad.output


# ------------------------------------------------------------------------------- slow / GPU


@pytest.mark.slow
@pytest.mark.long  # the sweep itself, in the suite: test_micro_batch_sweep_equals_direct_traces
def test_cli_sweep_prints_curves_and_plots(tmp_path: Path, tiny_text_file: Path) -> None:
    import yaml
    from typer.testing import CliRunner

    from memtrain.cli.app import app

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path, tiny_text_file, data={"max_length": 16})))
    png = tmp_path / "curves.png"
    args = ["estimate", str(path), "--sweep", "--device", "cpu", "--plot", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "peak vs micro-batch size" in result.stdout and "peak vs sequence length" in result.stdout
    assert png.stat().st_size > 0


@pytest.mark.slow
def test_70b_estimate_never_allocates_its_weights() -> None:
    """Llama-3.1-70B QLoRA at 4096 tokens in a fresh process: peak RSS far below the 35 GB of weights.

    Peak RSS is the process's own ``VmHWM``: ``ru_maxrss`` would include pytest's RSS, copied at fork.
    """
    code = (
        "import resource, memtrain\n"
        "r = {'model': {'name': 'meta-llama/Llama-3.1-70B', 'quantization': 'nf4', 'dtype': 'bf16'},"
        " 'data': {'source': 'builtin:shakespeare-spelling', 'max_length': 4096},"
        " 'training': {'micro_batch_size': 1}, 'memory': {'checkpointing': 'full'}}\n"
        "e = memtrain.estimate(r, device='cuda')\n"
        "hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
        "rss = int(hwm[0]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(e.peak_bytes, rss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    peak, rss = map(int, out.stdout.split()[-2:])
    assert peak > 35 * 2**30  # the weights are in the estimate...
    assert rss < 2 * 2**30  # ...but never in memory


@pytest.mark.slow
@pytest.mark.heavy
def test_reduced_benchmark_table_meets_the_error_bounds() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_estimate

    rows = [*bench_estimate.accuracy_rows(["llama"], ["qlora-nf4", "adamw-8bit"], [2], seq_len=64),
            *bench_estimate.accuracy_rows(["gpt2"], ["lora-checkpointing"], [4], seq_len=64)]
    errors = sorted(abs(r["error_pct"]) for r in rows)
    assert len(rows) == 3
    assert errors[len(errors) // 2] <= 2.0 and errors[-1] <= 5.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_estimate_matches_a_real_cuda_step(tmp_path: Path, tiny_text_file: Path) -> None:
    qlora = {"dtype": "bf16", "quantization": "nf4"}
    data = recipe(tmp_path, tiny_text_file, depth=7, model=qlora, memory={"checkpointing": "full"})
    cfg = load_recipe(data)
    predicted = estimate(cfg, device="cuda")
    measured = real_step.measure_recipe_step(cfg, resolve_config(cfg.model)[0])
    assert measured.cuda_max_allocated is not None
    assert abs(predicted.peak_bytes + predicted.overheads["allocator_rounding"] - measured.peak_bytes) \
        <= 0.02 * measured.peak_bytes


@pytest.mark.slow
def test_fsdp_recipe_is_estimated_per_process_with_sharded_state() -> None:
    base = ["training.micro_batch_size=2", "training.gradient_accumulation=1", "data.max_length=32",
            "adapter.method=full"]
    one = estimate("recipes/tiny-llama-shakespeare.yaml", base)
    two = estimate("recipes/tiny-llama-shakespeare.yaml", [*base, "distributed.processes=2"])
    assert any("FSDP2" in n for n in two.notes) and two.settings["sharding"] == "full"
    for category in ("parameters", "optimizer_state"):
        assert two.by_phase and two.category_at_phase_peak["optimizer"][category] == pytest.approx(
            one.category_at_phase_peak["optimizer"][category] / 2, rel=0.01)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_padded_batch_of_real_rows_holds_what_the_estimate_says(
        arch: str, tmp_path: Path, tiny_text_file: Path, tokenizer: Any) -> None:
    """Rows of several lengths padded by a collator take transformers' masked attention path, which
    the estimate traces; full rows without padding never hold more, and for Llama's grouped-query
    attention less (no keys and values repeated for every head, no 4D mask; GPT-2 has neither)."""
    from transformers import DataCollatorForSeq2Seq

    cfg = load_recipe(recipe(tmp_path, tiny_text_file, arch))
    config = resolve_config(cfg.model)[0]
    predicted = estimate(cfg, device="cpu").peak_bytes
    length = cfg.data.max_length
    collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    generator = torch.Generator().manual_seed(0)
    peaks = {}
    shapes = {"padded": [length - 5, length, length - 9, length - 1], "full": [length] * 4}
    for name, lengths in shapes.items():
        rows = []
        for n in lengths:
            ids = torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()
            rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": ids})
        peaks[name] = _trainer_step_peak(cfg, config, dict(collate(rows)), tmp_path)
    assert peaks["padded"] == predicted
    assert peaks["full"] < predicted if arch == "llama" else peaks["full"] <= predicted


def test_packed_rows_are_estimated_as_the_trainer_runs_them(tmp_path: Path, tiny_text_file: Path) -> None:
    """Rows of two packed examples, run as the Trainer runs them (no KV cache: it sets
    ``config.use_cache = TrainingArguments.use_cache``, False), get transformers' block-diagonal
    mask from the restarting position ids; the estimate is of that step."""
    from memtrain.data.packing import PackedCollator, pack_examples

    cfg = load_recipe(recipe(tmp_path, tiny_text_file, "llama", data={"packing": True}))
    config = resolve_config(cfg.model)[0]
    half = cfg.data.max_length // 2
    generator = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, config.vocab_size, (half,), generator=generator).tolist() for _ in range(8)]
    packed = pack_examples([(ids, ids) for ids in examples], cfg.data.max_length, split_long=True)
    batch = PackedCollator(0)([{k: packed[k][i] for k in packed} for i in range(4)])
    assert _trainer_step_peak(cfg, config, batch, tmp_path) == estimate(cfg, device="cpu").peak_bytes


def _trainer_step_peak(cfg: Any, config: Any, batch: dict, tmp_path: Path) -> int:
    """Peak of one step of the recipe's warm real model on ``batch``, set up as the Trainer sets it
    (``config.use_cache = TrainingArguments.use_cache``)."""
    from memtrain.memory.meter import MemoryMeter
    from memtrain.trainer.step import training_step

    settings = build.step_settings(cfg)
    with real_step.warm_recipe_step(cfg, config) as (_, model, optimizer, _):
        model.config.use_cache = TrainingArguments(output_dir=str(tmp_path), report_to="none").use_cache
        with MemoryMeter(model, optimizer, inputs=batch) as meter:
            training_step(model, batch, optimizer, settings["accumulation"], settings["max_grad_norm"])
    return meter.result().peak_bytes
