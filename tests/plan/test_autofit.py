"""Auto-fit micro-batch: the prediction, the probe that confirms it (stepping down when the
prediction is too optimistic), and a recipe run with ``training.micro_batch_size: auto``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import causal_recipe

from memtrain.config import RunConfig, load_recipe
from memtrain.config.batch import Batch, valid_batches
from memtrain.errors import MemtrainError
from memtrain.estimator.real_step import measure_recipe_step
from memtrain.estimator.setup import resolve_config
from memtrain.plan import autofit
from memtrain.trainer.build import build_model
from memtrain.trainer.trainer import build_trainer


def auto_recipe(tmp_path: Path, data: Path, budget: str | None = None, **memory: Any) -> RunConfig:
    training = {"micro_batch_size": "auto", "gradient_accumulation": None, "effective_batch_size": 16,
                "max_steps": 2}
    mem = {"simulate_budget": budget, **memory} if budget else memory
    return load_recipe(causal_recipe(tmp_path, data, adapter={"method": "full"}, training=training,
                                     memory=mem))


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, int]:
    """Measured step peaks (live bytes) of the tiny full fine-tune at micro-batches 4 and 8."""
    tmp = tmp_path_factory.mktemp("peaks")
    data = tmp / "t.jsonl"
    data.write_text('{"text": "x"}\n', encoding="utf-8")
    cfg = autofit.with_batch(auto_recipe(tmp, data), 4, 4)
    config, _ = resolve_config(cfg.model)
    return {m: measure_recipe_step(cfg, config, micro_batch=m).peak_bytes for m in (4, 8)}


def trainer_for(cfg: RunConfig, batch: Batch) -> Any:
    from memtrain.data.prepare import prepare_data
    from memtrain.model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    data = prepare_data(cfg, tokenizer)
    model = build_model(cfg, data.num_labels, tokenizer.pad_token_id)
    return build_trainer(autofit.with_batch(cfg, batch.micro, batch.accumulation), model, tokenizer, data,
                         batch, cfg.output.dir)


def test_valid_batches_keep_the_effective_batch(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = auto_recipe(tmp_path, tiny_text_file)
    assert valid_batches(cfg.training) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
    assert valid_batches(cfg.training, processes=2) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert all(m * a == 16 for m, a in valid_batches(cfg.training))


def test_grpo_micro_batches_make_whole_groups_of_completions() -> None:
    """``micro_batch_size: auto`` on a GRPO recipe without an effective batch: only micro-batches whose
    completions per step are whole groups of ``num_generations`` (TRL refuses the others); before,
    `memtrain plan` chose micro-batch 2 with 8 generations and printed a command that cannot train.
    The plan's command is a valid recipe."""
    from memtrain.config import shipped_recipes_dir
    from memtrain.plan import planner

    recipe = shipped_recipes_dir() / "tiny-llama-grpo.yaml"
    cfg = load_recipe(recipe, ["training.micro_batch_size=auto"])
    assert valid_batches(cfg.training)[:3] == [(8, 1), (16, 1), (24, 1)]
    fixed = load_recipe(recipe, ["training.micro_batch_size=auto", "training.gradient_accumulation=2"])
    assert valid_batches(fixed.training)[:3] == [(4, 2), (8, 2), (12, 2)]
    decided = planner.plan(cfg, "1GiB", device="cpu")
    assert decided.chosen.micro % 8 == 0 and decided.chosen.accumulation == 1
    load_recipe(recipe, [f"training.micro_batch_size={decided.chosen.micro}"])  # TRL's rule holds


def test_probe_steps_down_from_an_optimistic_prediction_and_leaves_nothing(
        tmp_path: Path, tiny_text_file: Path, peaks: dict[int, int]) -> None:
    assert peaks[8] > peaks[4] + 2**20
    cfg = auto_recipe(tmp_path, tiny_text_file, f"{peaks[4] + 2**16}B")
    trainer = trainer_for(cfg, Batch(16, 1))  # a prediction two valid sizes too large
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    probe = autofit.confirm(trainer, cfg, Batch(16, 1))
    assert probe.tried == [(16, False), (8, False), (4, True)] and probe.failed == 2
    assert probe.batch == Batch(4, 4) and probe.batch.effective == 16
    assert peaks[4] <= probe.peak_bytes <= probe.limit_bytes
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 4)
    # nothing left behind: parameters bit for bit, no gradients, no optimizer, no active tracker
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None
    assert trainer.optimizer is None
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not _get_current_dispatch_mode_stack()


def test_probe_keeps_a_prediction_that_fits(tmp_path: Path, tiny_text_file: Path,
                                            peaks: dict[int, int]) -> None:
    cfg = auto_recipe(tmp_path, tiny_text_file, f"{peaks[4] + 2**16}B")
    probe = autofit.confirm(trainer_for(cfg, Batch(4, 4)), cfg, Batch(4, 4))
    assert probe.tried == [(4, True)]


def test_nothing_fits_says_so_with_the_limit(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = auto_recipe(tmp_path, tiny_text_file, "1MiB")
    with pytest.raises(MemtrainError, match=r"not even micro-batch 1 of 32 tokens fits the 1\.00 MiB limit"):
        autofit.confirm(trainer_for(cfg, Batch(2, 8)), cfg, Batch(2, 8))


@pytest.mark.slow
def test_prediction_is_the_largest_that_fits(tmp_path: Path, tiny_text_file: Path,
                                             peaks: dict[int, int]) -> None:
    # CPU estimates are exact live bytes: with no margin the prediction is the true largest
    cfg = auto_recipe(tmp_path, tiny_text_file, f"{peaks[4] + 2**16}B", margin=0.0)
    planned, batch, predicted = autofit.predict(cfg)
    assert batch == Batch(4, 4) and planned.training.micro_batch_size == 4
    assert predicted <= peaks[4] + 2**16
    with_margin = auto_recipe(tmp_path, tiny_text_file, f"{peaks[4] + 2**16}B", margin=0.15)
    assert autofit.predict(with_margin)[1].micro < 4


@pytest.mark.slow
def test_recipe_run_with_auto_micro_batch_trains_within_the_budget(
        tmp_path: Path, peaks: dict[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.run import train as runner
    from memtrain.run.train import train

    # rows as long as data.max_length, of varying lengths: the probe steps on the batch `peaks` measured
    data = tmp_path / "long.jsonl"
    lines = [" ".join(["word"] * (100 if i % 8 else 5)) for i in range(64)]
    data.write_text("\n".join(f'{{"text": "{line}"}}' for line in lines), encoding="utf-8")
    cfg = auto_recipe(tmp_path, data, f"{peaks[4] + 2**16}B")
    optimistic = autofit.with_batch(cfg, 16, 1)  # the planner's prediction, two valid sizes too large
    monkeypatch.setattr(runner, "_plan", lambda c, console, rows: optimistic)
    result = train(cfg)
    assert result.batch == Batch(4, 4)
    assert not [e for e in result.log_history if "memory/recovered_micro_batch" in e]
    assert result.metrics["train_loss"] > 0


@pytest.mark.parametrize("memory", [{"offload": {"optimizer": True}}, {}],
                         ids=["offload", "in-backward"])
def test_probe_leaves_no_hooked_optimizer_behind(tmp_path: Path, tiny_text_file: Path,
                                                 memory: dict[str, Any]) -> None:
    # An offload or in-backward optimizer steps from gradient hooks that hold it: the probe's must go,
    # or training keeps a second copy of the host state and copies every gradient twice.
    import gc

    from memtrain.trainer.optimizer_offload import OffloadOptimizer

    cfg = auto_recipe(tmp_path, tiny_text_file, "1GiB", **memory)
    if not memory:
        training = cfg.training.model_copy(update={"optimizer_in_backward": True})
        cfg = cfg.model_copy(update={"training": training})
    trainer = trainer_for(cfg, Batch(4, 4))
    autofit.confirm(trainer, cfg, Batch(4, 4))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert all(not p._post_accumulate_grad_hooks for p in params)  # the probe's hooks are gone
    optimizer = trainer.create_optimizer()
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in params)
    assert hooks and all(len(p._post_accumulate_grad_hooks or {}) <= 1 for p in params)  # one optimizer's
    gc.collect()
    ours = set(params)
    live = [o for o in gc.get_objects()
            if isinstance(o, OffloadOptimizer) and ours & set(getattr(o, "param_d2h_map", {}))]
    assert live == ([optimizer] if memory else [])  # host copies and state: one optimizer's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_probe_is_confirmed_by_the_allocator(tmp_path: Path, tiny_text_file: Path) -> None:
    """With a real budget on CUDA the probe runs under the allocator's cap (reserved memory + the
    context), and the peak it reports is the allocator's, not the tensor bytes."""
    from memtrain.device import compute_device, outside_allocator_bytes

    training = {"micro_batch_size": "auto", "gradient_accumulation": None, "effective_batch_size": 16,
                "max_steps": 2}
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, adapter={"method": "full"}, training=training,
                                    memory={"budget": "2GiB", "margin": 0.0}))
    trainer = trainer_for(cfg, Batch(4, 4))
    trainer.model.to(compute_device())
    probe = autofit.confirm(trainer, cfg, Batch(4, 4))
    assert probe.tried == [(4, True)] and probe.peak_bytes is not None
    assert outside_allocator_bytes(compute_device()) < probe.peak_bytes <= 2 * 2**30
    assert torch.cuda.memory_reserved() < 2**30  # the cap is lifted and the cache given back


def test_a_grpo_probe_runs_trl_s_training_step_on_full_length_completions(tmp_path: Path) -> None:
    """The probe steps through TRL's compute_loss on the worst case generation hands it, so its peak
    is the traced training step's. It ran the model's own loss on prompt-length rows: no
    completions, no log-probability head (178 MiB where the step holds 446 MiB), and said
    "confirmed"."""
    from memtrain.data.prepare import prepare_data
    from memtrain.estimator.estimate import estimate
    from memtrain.model import load_tokenizer
    from memtrain.trainer.grpo import build_grpo_trainer

    cfg = load_recipe("recipes/tiny-llama-grpo.yaml", [
        "data.max_examples=64", "training.micro_batch_size=8", "training.gradient_accumulation=4",
        "memory.simulate_budget=2GiB", f"output.dir={tmp_path / 'run'}"])
    tokenizer = load_tokenizer(cfg.model)
    data = prepare_data(cfg, tokenizer)
    model = build_model(cfg, None, tokenizer.pad_token_id)
    trainer = build_grpo_trainer(cfg, model, tokenizer, data, Batch(8, 4), cfg.output.dir)
    rows = data.rows(cfg)
    probe = autofit.confirm(trainer, cfg, Batch(8, 4), rows=rows)
    assert probe.tried == [(8, True)]
    assert "TRL's GRPO training step on" in autofit.describe(probe, rows.longest)
    predicted = estimate(cfg, rows=rows).peak_bytes
    assert abs(probe.peak_bytes / predicted - 1) < 0.01, (probe.peak_bytes, predicted)
