"""The memory meter: exact categories on CPU, phases, host bucket, fake tensors, Trainer logs."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_CONFIGS
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.memory.meter import MemoryMeter, generating, mark_host
from memtrain.trainer.step import measure_step


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    values = copy.deepcopy(TINY_CONFIGS["llama"])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def batch(b: int = 4, t: int = 32) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 30522, (b, t), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_categories_add_up_and_repeat_exactly() -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = [measure_step(model, batch(), opt) for _ in range(3)]
    for r in steps:
        assert sum(r.peak_by_category.values()) == r.peak_bytes
        assert r.peak_by_category["parameters"] == param_bytes(model)
        assert set(r.peak_by_phase) == {"forward", "backward", "optimizer"}
        assert max(r.peak_by_phase.values()) == r.peak_bytes
    # steps 2 and 3 hold the same state: identical measurements, byte for byte
    assert steps[1].to_dict() == steps[2].to_dict()


def test_text_generated_inside_a_step_is_its_own_phase() -> None:
    """GRPO generates completions inside a training step: ops under ``generating()`` are the
    ``generation`` phase, whose peak is what generation held (weights + its tensors), not mixed into
    the forward's. Planted: the tracker ignoring the flag files the generation as forward and fails."""
    model = tiny_llama()
    params = param_bytes(model)
    with MemoryMeter(model) as meter:
        with torch.no_grad(), generating():
            cache = torch.zeros(64, 2**20, dtype=torch.uint8)  # 64 MiB: the "KV cache"
            model(input_ids=batch(b=1, t=8)["input_ids"])
            del cache
        model(**batch()).loss.backward()
    phases = meter.result().peak_by_phase
    assert set(phases) == {"generation", "forward", "backward"}
    assert 64 * 2**20 + params < phases["generation"] < 66 * 2**20 + params  # + the small forward
    assert phases["forward"] < phases["generation"]  # the cache was freed before the forward
    with MemoryMeter(model) as meter:  # outside generating(): no such phase
        model(**batch()).loss.backward()
    assert "generation" not in meter.result().peak_by_phase


def test_optimizer_state_is_adam_moments() -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measure_step(model, batch(), opt)
    r = measure_step(model, batch(), opt)
    n_params = len(list(model.parameters()))
    # exp_avg + exp_avg_sq per parameter, plus one 4-byte `step` scalar per parameter
    assert r.max_by_category["optimizer_state"] >= 2 * param_bytes(model) + 4 * n_params


def test_activations_grow_with_batch() -> None:
    model = tiny_llama()
    small = measure_step(model, batch(b=2)).max_by_category["activations"]
    large = measure_step(model, batch(b=8)).max_by_category["activations"]
    assert large > 3.5 * small


def test_mark_host_moves_bytes_out_of_the_device_peak() -> None:
    keep = []
    with MemoryMeter(device="cpu") as meter:
        x = torch.ones(1024, 1024)  # 4 MiB on the device
        y = torch.ones(1024, 1024)
        mark_host(y)  # counted as host from here on
        keep += [x, y]
        z = torch.ones(1024, 1024)  # the device now holds x and z; y is host
        keep.append(z)
    r = meter.result()
    assert r.peak_bytes == 2 * 4 * 2**20  # both were on the device before the move
    assert r.host_peak_bytes == 4 * 2**20


def test_fake_step_measures_like_the_real_one() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real_model = tiny_llama()
    real = measure_step(real_model, batch(), torch.optim.AdamW(real_model.parameters()))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_model = tiny_llama()
        fake_batch = {k: mode.from_tensor(v) for k, v in batch().items()}
        fake = measure_step(fake_model, fake_batch, torch.optim.AdamW(fake_model.parameters()))
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_by_category == real.peak_by_category


@pytest.mark.slow
def test_callback_logs_memory_with_gradient_accumulation(tmp_path) -> None:
    from conftest import causal_recipe

    from memtrain.config import load_recipe
    from memtrain.run.train import train

    data = tmp_path / "t.jsonl"
    data.write_text("\n".join(f'{{"text": "to be or not to be {i}"}}' for i in range(32)))
    cfg = load_recipe(causal_recipe(tmp_path, data, training={"gradient_accumulation": 2,
                                                              "micro_batch_size": 2}))
    result = train(cfg)
    assert result.memory is not None and result.memory.peak_bytes > 0
    logged = [h for h in result.log_history if "memory/peak_mib" in h]
    assert logged and all(h["memory/peak_mib"] > 0 for h in logged)


def test_tensors_of_a_nested_fake_mode_are_not_memory() -> None:
    """DTensor computes an FSDP2 op's layout under a fake mode of its own; those tensors hold no
    memory. torch 2.13's tracker skips them in its dispatch, torch 2.11's counted them (AdamW's
    step on FSDP2 shards measured 5x the optimizer state): memtrain's trackers skip them at
    ``_track`` on any torch (a tracker without the check counts the 4 MiB below)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _MemRefType

    from memtrain.memory import trackers

    cpu = torch.device("cpu")
    tracker = trackers.Tracker(cpu, torch.device("cpu", 1), False)
    with tracker:
        total = lambda: tracker.get_tracker_snapshot("current").get(cpu, {}).get(_TOTAL_KEY, 0)  # noqa: E731
        before = total()
        with FakeTensorMode():
            layout = torch.empty(2**20)  # fake: 4 MiB of nothing
            tracker._track(_MemRefType.TEMP, layout)
        assert total() == before
        real = torch.empty(2**20)
        tracker._track(_MemRefType.TEMP, real)
        assert total() == before + 4 * 2**20


def test_the_report_step_is_one_like_the_others_not_the_first(tmp_path) -> None:
    """The first optimizer step runs before the optimizer's state exists, which every later step
    holds and the estimator predicts. Where the run's longest batch comes only in the first step,
    the step reported (``worst``) is the highest of the later ones, and the run's largest batch is
    still known. An outside user's full fine-tuning run compared its first step (84 MiB, no Adam
    state) with the prediction for that batch with state (114.6 MiB): 1.36x. Planted: the rank
    ignoring the first step's missing state -> the first step is reported, fails."""
    from plain_trainer import arguments, collate, token_dataset
    from plain_trainer import tiny_model as plain_model
    from transformers import Trainer

    from memtrain.trainer.callbacks import MemoryMeterCallback

    meter = MemoryMeterCallback(every=1)
    # sequential batches of 2: the first holds the longest rows, the next two short ones
    trainer = Trainer(model=plain_model(), args=arguments(tmp_path, 2, 1, 3),
                      train_dataset=token_dataset("causal-lm", [64, 64, 8, 8, 8, 8]), data_collator=collate)
    meter.attach(trainer)
    trainer.train()
    assert [meter.steps[s].before_optimizer_state for s in (1, 2, 3)] == [True, False, False]
    assert meter.steps[1].peak_bytes > max(meter.steps[s].peak_bytes for s in (2, 3))  # the long rows
    assert meter.worst is not meter.steps[1] and not meter.worst.before_optimizer_state
    assert meter.largest == (2, 64) and meter.worst.batch == (2, 8)
