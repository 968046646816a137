"""The one device decision (memtrain.device) and budgets checked by the allocator on CUDA.

The device logic runs here on a CPU with CUDA's answers monkeypatched; the tests that need a
GPU are skipped cleanly without one.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import TINY_CONFIGS
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain import device
from memtrain.reliability.budget import SimulatedBudget, budget_guard

GiB = 2**30
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    values = copy.deepcopy(TINY_CONFIGS["llama"])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def test_compute_device_is_the_local_ranks_gpu_else_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.compute_device() == torch.device("cpu") and device.device_type() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device.compute_device() == torch.device("cuda", 1) and device.device_type() == "cuda"
    monkeypatch.delenv("LOCAL_RANK")
    assert device.compute_device() == torch.device("cuda", 0)


def test_place_moves_every_dtype_to_the_compute_device_but_not_device_mapped_models() -> None:
    target = torch.device("meta")  # stands in for a GPU: a real move, without one
    for dtype in (torch.float32, torch.bfloat16):
        model = device.place(tiny_llama(dtype), target)
        assert {p.device.type for p in model.parameters()} == {"meta"}
    mapped = tiny_llama()
    mapped.hf_device_map = {"": "cpu"}  # placed by from_pretrained(device_map=...): left alone
    assert {p.device.type for p in device.place(mapped, target).parameters()} == {"cpu"}
    assert {p.device.type for p in device.place(tiny_llama(), torch.device("cpu")).parameters()} == {"cpu"}


def test_measured_and_timed_steps_build_on_the_compute_device(
        monkeypatch: pytest.MonkeyPatch, tmp_path, tiny_text_file) -> None:
    from conftest import causal_recipe

    from memtrain.config import load_recipe
    from memtrain.estimator import real_step
    from memtrain.estimator.setup import resolve_config

    placed = []

    def place(model: torch.nn.Module, where: torch.device | None = None) -> torch.nn.Module:
        placed.append(model)
        return model

    monkeypatch.setattr(device, "place", place)
    for dtype in ("bf16", "fp32"):  # before: only 4-bit models were put on the GPU
        cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, model={"dtype": dtype},
                                        data={"max_length": 16}, training={"micro_batch_size": 2}))
        with real_step.warm_recipe_step(cfg, resolve_config(cfg.model)[0]) as (_step, model, _opt, batch):
            assert placed[-1] is model
            assert batch["input_ids"].device == next(model.parameters()).device


def test_allocator_fraction_keeps_reserved_plus_context_under_the_budget() -> None:
    total, context = 80 * GiB, GiB // 2
    fraction = device.allocator_fraction(10 * GiB, total, context)
    assert fraction * total + context == pytest.approx(10 * GiB)
    assert device.allocator_fraction(100 * GiB, total, context) == 1.0
    with pytest.raises(ValueError, match="used up by the"):
        device.allocator_fraction(context, total, context)


def test_budget_guard_uses_the_allocator_on_cuda_and_tensor_bytes_on_cpu_or_when_simulated() -> None:
    gpu = torch.device("cuda", 0)  # constructing the guard touches no GPU
    assert isinstance(budget_guard(GiB, device=gpu), device.AllocatorBudget)
    assert isinstance(budget_guard(GiB, device=gpu, simulated=True), SimulatedBudget)
    assert isinstance(budget_guard(GiB, device=torch.device("cpu")), SimulatedBudget)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        device.AllocatorBudget(GiB, torch.device("cpu"))


@cuda
def test_allocator_budget_raises_at_the_allocation_over_the_budget_and_cleans_up() -> None:
    gpu = device.compute_device()
    with device.AllocatorBudget(2 * GiB, gpu) as guard:
        keep = torch.empty(GiB // 2, dtype=torch.uint8, device=gpu)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GiB, dtype=torch.uint8, device=gpu)
        assert GiB // 2 <= guard.peak_bytes <= 2 * GiB
        del keep
    assert cached_free_segments() == []  # the cap is lifted and the cache given back
    torch.empty(3 * GiB, dtype=torch.uint8, device=gpu)  # no cap left behind


def cached_free_segments() -> list[dict]:
    """Segments the caching allocator holds with nothing allocated in them: what ``empty_cache``
    gives back. Not ``memory_reserved() == 0``: blocks other code keeps alive (cuBLAS workspaces,
    bitsandbytes' quantization maps, earlier tests' tensors) stay reserved, 86 MiB of them on an
    H100 when this file ran after the estimate tests."""
    return [seg for seg in torch.cuda.memory_snapshot() if seg["allocated_size"] == 0]


@cuda
def test_calibration_leaves_no_memory_reserved(tmp_path) -> None:
    from memtrain.estimator.calibrate import calibrate

    calibrate(tmp_path / "profile.json", quick=True)
    assert cached_free_segments() == []


def test_allocator_settings_default_to_expandable_segments_and_respect_the_user(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain import allocator

    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator.settings() == "expandable_segments:True" and allocator.expandable_segments()
    assert device.configure_allocator() == "expandable_segments:True"
    assert os.environ[allocator.ENV] == "expandable_segments:True"  # inherited by launched workers
    monkeypatch.setenv(allocator.ENV, "max_split_size_mb:256,garbage_collection_threshold:0.6")
    assert device.configure_allocator() == "max_split_size_mb:256,garbage_collection_threshold:0.6"
    assert not allocator.expandable_segments()
    assert allocator.expandable_segments("garbage_collection_threshold:0.6, expandable_segments:True")
    assert not allocator.expandable_segments("expandable_segments:False")


def test_the_command_line_sets_the_allocator_before_cuda_starts(tmp_path) -> None:
    """`memtrain` passes its settings to every process it starts (workers, calibrate, bench rows)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    code = ("import os; from memtrain.cli import app\n"
            "app.app = lambda: print('ALLOC=' + os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''), flush=True)\n"
            "app.main()")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ALLOC=expandable_segments:True" in out.stdout

