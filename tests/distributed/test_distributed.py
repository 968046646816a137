"""Several processes with FSDP2: sharding, launch, equivalence with one process, memory, saving.

Fast tests shard real tiny models inside a *fake* process group (this process plays rank 0 of
2; collectives do nothing), which shows the structure of the sharding without starting
processes. The slow tests launch 2 real processes on CPU (gloo) through ``memtrain.run.train.train``,
exactly as ``memtrain train --nproc 2`` does, and compare them with a 1-process run of the same
global batch.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from conftest import TINY_CONFIGS, causal_recipe, merge
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain import patches
from memtrain.config import dump_recipe, load_recipe
from memtrain.distributed import fsdp as distributed
from memtrain.distributed import sharding as sharding_decisions
from memtrain.errors import MemtrainError
from memtrain.estimator.estimate import estimate
from memtrain.model import load_model
from memtrain.run import launch
from memtrain.units import parse_size

pytestmark = pytest.mark.distributed


def tiny_llama(**overrides: Any) -> torch.nn.Module:
    values = {**copy.deepcopy(TINY_CONFIGS["llama"]), **overrides}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))


def run_config(tmp: Path, corpus: Path, method: str = "full", processes: int = 2, **sections: Any) -> Any:
    """A recipe whose global batch (8 packed blocks of 32 tokens) is the same for 1 and 2 processes."""
    recipe = causal_recipe(
        tmp, corpus, adapter={"method": method, "r": 4, "alpha": 8, "dropout": 0.0},
        data={"packing": True},
        training={"micro_batch_size": 8 // processes, "max_steps": 3,
                  "learning_rate": 1e-3 if method == "full" else 1e-2},
        distributed={"processes": processes},
        output={"dir": str(tmp / f"{method}-{processes}")})
    return load_recipe(merge(recipe, sections))


def local_and_total(model: torch.nn.Module) -> tuple[int, int]:
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return local, total


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.jsonl"
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(64)]
    path.write_text("\n".join(json.dumps({"text": t}) for t in lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------ sharding (fake process group)


def test_shard_model_makes_every_weight_a_half_size_dtensor(tmp_path: Path, text_file: Path) -> None:
    cfg = run_config(tmp_path, text_file)
    with distributed.fake_process_group(2) as mesh:
        model = distributed.shard_model(tiny_llama(), cfg, mesh)
        assert isinstance(model, FSDPModule)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        local, total = local_and_total(model)
        assert local * 2 == total  # every dim 0 of the tiny Llama is even: no padding
        units = patches.records(model)[-1].modules
        assert units == ["model.layers.0", "model.layers.1", "model.embed_tokens", "lm_head", "(root)"]


def test_lora_base_weights_are_sharded_too(tmp_path: Path, text_file: Path) -> None:
    cfg = run_config(tmp_path, text_file, method="lora")
    with distributed.fake_process_group(2) as mesh:
        model = distributed.shard_model(patches.apply_patches(tiny_llama(), cfg), cfg, mesh)
        frozen = [p for p in model.parameters() if not p.requires_grad]
        trained = [p for p in model.parameters() if p.requires_grad]
        assert frozen and trained and all(isinstance(p, DTensor) for p in frozen + trained)
        assert [r.name for r in patches.records(model)] == ["lora", "fsdp"]


def test_tied_embeddings_stay_in_the_root_unit(tmp_path: Path, text_file: Path) -> None:
    cfg = run_config(tmp_path, text_file)
    with distributed.fake_process_group(2) as mesh:
        model = distributed.shard_model(tiny_llama(tie_word_embeddings=True), cfg, mesh)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert patches.records(model)[-1].modules == ["model.layers.0", "model.layers.1", "(root)"]


def test_policies_follow_the_recipe(tmp_path: Path, text_file: Path) -> None:
    cfg = run_config(tmp_path, text_file, memory={"offload": {"parameters": True}})
    assert distributed.mixed_precision(tiny_llama()).reduce_dtype is None  # fp32: nothing to do
    assert distributed.mixed_precision(tiny_llama().bfloat16()).reduce_dtype is torch.float32
    plugin = distributed.fsdp_plugin(tiny_llama(), cfg)
    assert plugin is not None and plugin.fsdp_version == 2
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    with distributed.fake_process_group(2) as mesh:
        model = distributed.shard_model(tiny_llama(), cfg, mesh)
        assert "offloaded" in patches.records(model)[-1].detail
        ids = torch.randint(0, 100, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()  # forward/backward through offloaded shards
        assert all(p.device.type == "cpu" and p.grad is not None for p in model.parameters())


def test_grad_op_keeps_each_layer_gathered_from_forward_to_backward(tmp_path: Path, text_file: Path) -> None:
    ids = torch.randint(0, 100, (2, 8))
    for sharding, kept in (("full", False), ("grad_op", True)):
        cfg = run_config(tmp_path, text_file, distributed={"sharding": sharding})
        assert distributed.fsdp_plugin(tiny_llama(), cfg).reshard_after_forward is not kept
        with distributed.fake_process_group(2) as mesh:
            model = distributed.shard_model(tiny_llama(), cfg, mesh)
            loss = model(input_ids=ids, labels=ids).loss
            whole = [not isinstance(p, DTensor) for p in model.model.layers.parameters()]
            assert all(whole) if kept else not any(whole)
            loss.backward()  # backward reshards both
            assert all(isinstance(p, DTensor) for p in model.model.layers.parameters())


def test_one_process_or_no_sharding_leaves_the_model_alone(tmp_path: Path, text_file: Path) -> None:
    model = tiny_llama()
    for cfg in (run_config(tmp_path, text_file, processes=1),
                run_config(tmp_path, text_file, distributed={"sharding": "none"})):
        assert distributed.shard_model(model, cfg) is model and not isinstance(model, FSDPModule)
        assert distributed.fsdp_plugin(model, cfg) is None
    with pytest.raises(MemtrainError, match="sharding"):
        distributed.shard_model(model, run_config(tmp_path, text_file, distributed={"sharding": "auto"}))
    with pytest.raises(MemtrainError, match=r"offload\.parameters.*several processes"):
        distributed.shard_model(model, run_config(tmp_path, text_file, processes=1,
                                                  memory={"offload": {"parameters": True}}))


def test_a_model_without_layer_classes_is_refused() -> None:
    model = tiny_llama()
    model._no_split_modules = ["NoSuchLayer"]
    with pytest.raises(patches.NoMatchError, match="sharding: none"):
        distributed.layer_classes(model)


def test_4bit_storage_is_the_compute_dtype_when_sharded(tmp_path: Path, text_file: Path) -> None:
    nf4 = {"model": {"quantization": "nf4", "dtype": "bf16"}}
    assert sharding_decisions.quant_storage(run_config(tmp_path, text_file, "lora", **nf4)) is torch.bfloat16
    assert sharding_decisions.quant_storage(run_config(tmp_path, text_file, "lora", 1, **nf4)) is None
    assert sharding_decisions.quant_storage(run_config(tmp_path, text_file, "lora")) is None


# ----------------------------------------------------------------------------- launch plumbing


def test_launch_is_needed_once_and_world_size_must_agree(tmp_path: Path, text_file: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = run_config(tmp_path, text_file)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.launch_needed(cfg)
    assert not launch.launch_needed(run_config(tmp_path, text_file, processes=1))
    monkeypatch.setenv("WORLD_SIZE", "2")  # inside a launched process: train, do not launch
    assert not launch.launch_needed(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(MemtrainError, match=r"distributed\.processes=4"):
        launch.launch_needed(cfg)


def failure(tmp_path: Path, rank: int, exitcode: int, data: dict | None) -> ProcessFailure:
    error_file = tmp_path / f"error-{rank}.json"
    if data is not None:
        error_file.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_launch_errors_name_the_root_cause(tmp_path: Path) -> None:
    killed = failure(tmp_path, 0, -15, None)  # stopped by the agent after rank 1 failed
    user = failure(tmp_path, 1, 2, {"message": "`data.source`: bad", "timestamp": killed.timestamp + 5})
    err = launch._launch_error(ChildFailedError("w", {0: killed, 1: user}), 2)
    assert (str(err), err.exit_code) == ("`data.source`: bad (in training process 1 of 2)", 2)
    bug = failure(tmp_path, 1, 1, {"message": {"message": "KeyError: 'x'", "extraInfo": {
        "py_callstack": "...", "timestamp": str(killed.timestamp)}}})
    err = launch._launch_error(ChildFailedError("w", {0: killed, 1: bug}), 2)
    assert err.exit_code == 1 and "process 1 of 2 failed: KeyError: 'x'" in str(err)
    # No error file anywhere: the process the agent did not stop (SIGTERM) is the cause, even
    # when the agent's SIGTERM is stamped first; SIGKILL is explained as the OOM killer's.
    oom = failure(tmp_path, 2, -9, None)
    oom.timestamp = killed.timestamp + 5
    err = launch._launch_error(ChildFailedError("w", {0: killed, 2: oom}), 3)
    assert err.exit_code == 1 and "process 2 of 3 was killed (SIGKILL)" in str(err), str(err)


def test_cli_nproc_sets_the_number_of_processes(tmp_path: Path, text_file: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import memtrain.run.train
    from memtrain.cli.app import app

    seen = []
    monkeypatch.setattr(memtrain.run.train, "train", lambda cfg, console: seen.append(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(causal_recipe(tmp_path, text_file)), encoding="utf-8")
    result = CliRunner().invoke(app, ["train", str(recipe), "--nproc", "2"])
    assert result.exit_code == 0, result.output
    assert seen[0].distributed.processes == 2
    agreeing = CliRunner().invoke(app, ["train", str(recipe), "distributed.processes=2", "--nproc", "2"])
    assert agreeing.exit_code == 0, agreeing.output
    # both, disagreeing: refused (--nproc silently won)
    both = CliRunner().invoke(app, ["train", str(recipe), "distributed.processes=3", "--nproc", "2"])
    assert both.exit_code == 2 and len(seen) == 2
    said = " ".join(both.output.split())
    assert "`--nproc 2` and `distributed.processes=3` ask for different numbers" in said


# ---------------------------------------------------------------- real runs with 2 processes
# (marked long: CI runs them after the suite; in the suite, FSDP2 trains for real in
# test_plan_picks_sharding_under_a_budget_and_every_rank_stays_under_it)


def train_runs(tmp: Path, corpus: Path, method: str, **sections: Any) -> dict[int, Any]:
    from memtrain.run.train import train

    return {n: train(run_config(tmp, corpus, method, n, **sections)) for n in (1, 2)}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> dict[int, Any]:
    return train_runs(tmp_path_factory.mktemp("full"), text_file, "full")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> dict[int, Any]:
    # activation checkpointing on: it must compose with FSDP2's per-layer all-gathers; with the
    # memory report, which predicts each process's peak
    return train_runs(tmp_path_factory.mktemp("lora"), text_file, "lora", memory={"checkpointing": "full"},
                      output={"report": True})


def losses(result: Any) -> list[float]:
    return [h["loss"] for h in result.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_processes_train_like_one_on_the_same_global_batch(method: str, request: Any) -> None:
    runs = request.getfixturevalue(f"{method}_runs")
    two, one = losses(runs[2]), losses(runs[1])
    assert len(two) == 3 and two[-1] < two[0]
    # same examples, same initial weights; only the order of float reductions differs
    assert two == pytest.approx(one, rel=1e-5)
    assert "FSDP2 over 2 processes" in runs[2].patches[-1]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("method", ["full", "lora"])
def test_each_process_holds_half_the_state(method: str, request: Any) -> None:
    runs = request.getfixturevalue(f"{method}_runs")
    cfg = load_recipe(yaml.safe_load((runs[2].output_dir / "recipe.yaml").read_text()))
    # AdamW keeps one 4-byte `step` scalar per trained tensor, replicated in every process.
    steps = 4 * sum(p.requires_grad for p in patches.apply_patches(tiny_llama(), cfg).parameters())
    single = runs[1].memory
    assert len(runs[2].process_memory) == 2
    for measured in runs[2].process_memory:
        # Exact halves: every dim 0 of the tiny Llama and of the LoRA factors is even, so the
        # shards need no padding (an odd one would add at most one row per tensor).
        for category in ("parameters", "gradients"):
            assert measured.max_by_category[category] * 2 == single.max_by_category[category], category
        state, single_state = measured.peak_by_category["optimizer_state"], single.peak_by_category[
            "optimizer_state"]
        assert single_state > steps and state == (single_state - steps) // 2 + steps
        assert single.max_by_category["unsharded"] == 0 < measured.max_by_category["unsharded"]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("method", ["full", "lora"])
def test_estimate_predicts_the_per_process_peak(method: str, request: Any) -> None:
    runs = request.getfixturevalue(f"{method}_runs")
    cfg = load_recipe(yaml.safe_load((runs[2].output_dir / "recipe.yaml").read_text()))
    predicted = estimate(cfg)  # one of the 2 processes, traced in a fake process group
    measured = runs[2].process_memory[0]
    # packed rows: transformers builds a block-diagonal attention mask the estimate (every row one
    # full-length example) does not hold; the exact comparison is test_plan_picks_sharding_...
    assert predicted.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)
    for category in ("parameters", "optimizer_state", "unsharded"):
        assert predicted.by_category[category] == measured.peak_by_category[category]


@pytest.mark.slow
@pytest.mark.long
def test_the_report_of_two_processes_compares_with_a_process_s_prediction(lora_runs: dict[int, Any]) -> None:
    """The run's memory report and logs hold the per-process prediction beside rank 0's measured
    step (they said "no prediction to compare with": the report estimated only one process)."""
    from memtrain.memory.report import load_report

    report = load_report(lora_runs[2].output_dir)
    assert report.predicted is not None
    predicted = report.compared()["peak_bytes"]
    # packed rows: the block-diagonal mask is not in the estimate (test_estimate_predicts_...)
    assert predicted == pytest.approx(report.measured["peak_bytes"], rel=0.05)
    logged = [h for h in lora_runs[2].log_history if "memory/predicted_peak_mib" in h]
    assert logged and logged[-1]["memory/predicted_peak_mib"] * 2**20 == pytest.approx(
        report.predicted["peak_bytes"], rel=1e-3)


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 30522, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.long
def test_saved_full_model_reloads_and_matches_one_process(full_runs: dict[int, Any]) -> None:
    two, one = (AutoModelForCausalLM.from_pretrained(full_runs[n].output_dir) for n in (2, 1))
    untrained = logits(tiny_llama())
    assert not torch.allclose(logits(two), untrained, atol=1e-3)  # the trained weights were saved
    torch.testing.assert_close(logits(two), logits(one), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.long
def test_saved_adapter_reloads_and_matches_one_process(lora_runs: dict[int, Any]) -> None:
    from peft import PeftModel

    cfg = load_recipe(yaml.safe_load((lora_runs[2].output_dir / "recipe.yaml").read_text()))
    reloaded = {n: PeftModel.from_pretrained(load_model(cfg.model, seed=cfg.training.seed),
                                             str(lora_runs[n].output_dir)) for n in (1, 2)}
    base = logits(load_model(cfg.model, seed=cfg.training.seed))
    assert not torch.allclose(logits(reloaded[2]), base, atol=1e-3)
    torch.testing.assert_close(logits(reloaded[2]), logits(reloaded[1]), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> dict[int, Any]:
    # An evaluation after every step: on a CPU with AVX512-BF16, bitsandbytes would repack the
    # 4-bit weights in the first no-grad eval forward (memtrain.model.keep_4bit_trainable_on_cpu
    # turns that off); under FSDP2 the repack would also meet the next all-gather's bytes.
    sections = {"model": {"quantization": "nf4"}, "data": {"eval_split": 0.25}, "training": {"eval_steps": 1}}
    return train_runs(tmp_path_factory.mktemp("qlora"), text_file, "lora", **sections)


@pytest.mark.slow
@pytest.mark.long
def test_qlora_trains_in_two_processes_like_one(qlora_runs: dict[int, Any]) -> None:
    from peft import PeftModel

    two, one = losses(qlora_runs[2]), losses(qlora_runs[1])
    assert len(two) == 3 and two[-1] < two[0]
    # Same examples and weights (the 4-bit bytes are the same, stored as fp32 when sharded: the
    # compute dtype), fp32 compute; only the order of float reductions differs.
    assert two == pytest.approx(one, rel=1e-5)
    evals = [[h["eval_loss"] for h in qlora_runs[n].log_history if "eval_loss" in h] for n in (2, 1)]
    assert len(evals[0]) == 4 and evals[0] == pytest.approx(evals[1], rel=1e-5)  # each step, the end
    result = qlora_runs[2]
    assert result.patches[0].startswith("QLoRA") and "FSDP2 over 2 processes" in result.patches[-1]
    # the adapter trained on sharded 4-bit weights (float storage) loads onto a default 4-bit base
    cfg = load_recipe(yaml.safe_load((result.output_dir / "recipe.yaml").read_text()))
    model = PeftModel.from_pretrained(load_model(cfg.model, seed=cfg.training.seed), str(result.output_dir))
    assert torch.isfinite(logits(model)).all()


@pytest.mark.slow
@pytest.mark.long
def test_each_process_holds_half_the_4bit_weights(qlora_runs: dict[int, Any]) -> None:
    from memtrain.memory.quantized import quantization_state_tensors

    cfg = load_recipe(yaml.safe_load((qlora_runs[1].output_dir / "recipe.yaml").read_text()))
    model = load_model(cfg.model, seed=cfg.training.seed)
    packed = sum(p.numel() * p.element_size() for p in model.parameters() if type(p).__name__ == "Params4bit")
    # absmax and code books: small, outside the parameters, kept whole in every process
    constants = sum(t.numel() * t.element_size() for t in quantization_state_tensors(model))
    single = qlora_runs[1].memory.max_by_category["parameters"]  # all weights, constants included
    assert packed > 0 and constants > 0
    for measured in qlora_runs[2].process_memory:
        # Exact: every weight, 4-bit ones included, is half; the constants are whole. Were the
        # 4-bit weights whole in each process, this would be `packed / 2` bytes more.
        assert measured.max_by_category["parameters"] == (single - constants) // 2 + constants


# ------------------------------------------------------------- several machines, one process each

REPO = Path(__file__).resolve().parents[2]


def _environment(**extra: str) -> dict[str, str]:
    """This environment for processes started here, with memtrain (this checkout) importable."""
    import os

    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(600)
def test_two_machines_shard_over_both_and_train_like_one_process(
        tmp_path: Path, text_file: Path, full_runs: dict[int, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two memtrain launches on this machine play two machines (127.0.0.1, one process each)."""
    import subprocess
    import sys

    from memtrain.run.train import train

    cluster = {"processes": 2, "nodes": 2, "node_rank": 0, "master_addr": "127.0.0.1",
               "master_port": _free_port()}
    path = tmp_path / "recipe.yaml"
    path.write_text(dump_recipe(run_config(tmp_path, text_file, distributed=cluster)), encoding="utf-8")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # four Python processes share this machine's cores
    command = [sys.executable, "-m", "memtrain", "train", str(path), "distributed.node_rank=1"]
    other = subprocess.Popen(command, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        result = train(load_recipe(path))
    finally:
        output, _ = other.communicate(timeout=300)
    assert other.returncode == 0, output
    # Both processes hold half of every weight, gradient and optimizer state: one FSDP2 world of 2.
    assert "FSDP2 over 2 processes" in result.patches[-1]
    single = full_runs[1].memory
    assert len(result.process_memory) == 2  # gathered from both machines
    for measured in result.process_memory:
        for category in ("parameters", "gradients"):
            assert measured.max_by_category[category] * 2 == single.max_by_category[category], category
    # Same 8 examples per step (4 on each machine) and initial weights as one process with 8;
    # only the order of float reductions differs (fp32: a few ulps, far below 1e-5).
    assert losses(result) == pytest.approx(losses(full_runs[1]), rel=1e-5)


# ------------------------------------------------ auto-fit and recovery with one process short of memory


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(600)
def test_one_process_short_of_memory_sets_the_micro_batch_and_splits_the_step_of_all(
        tmp_path: Path, text_file: Path, full_runs: dict[int, Any], monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Process 1 alone gets smaller budgets (tests/rank_budget_worker.py): 72 MiB for the
    auto-fit probe, where micro-batch 4 needs 76 MiB and 2 needs 68 MiB (exact live bytes on
    CPU), and 64 MiB in training, where micro-batch 2 reaches 67 MiB once the optimizer state
    exists (step 2) and micro-batch 1 stays near 60 MiB. Process 0 has the recipe's 1 GiB."""
    from memtrain.run.train import train

    monkeypatch.setattr(launch, "WORKER_MODULE", "rank_budget_worker")
    tests = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", _environment()["PYTHONPATH"] + f":{tests}")
    monkeypatch.setenv("MEMTRAIN_TEST_RANK_BUDGETS", json.dumps({"1": {"probe": "72MiB", "train": "64MiB"}}))
    cfg = run_config(tmp_path, text_file, "full", memory={"simulate_budget": "1GiB"}, training={
        "effective_batch_size": 8, "micro_batch_size": "auto", "gradient_accumulation": None})
    result = train(cfg)
    captured = capfd.readouterr()
    shown = " ".join((captured.out + captured.err).split())  # the processes' terminal, unwrapped
    # the probe: 4 fits process 0 only, so both keep 2 (the smallest that fits any of them)
    assert "4 out of memory in process(es) [1], 2 fits" in shown
    assert (result.batch.micro, result.batch.accumulation, result.batch.effective) == (2, 2, 8)
    # training: process 1 went over in step 2; both split to 1 example x 4 and redid the step
    recovered = [h for h in result.log_history if "memory/recovered_micro_batch" in h]
    assert [(h["step"], h["memory/recovered_micro_batch"], h["memory/recovered_accumulation"])
            for h in recovered] == [(2, 1.0, 4.0)]  # stamped with the step being redone
    assert "process(es) [1] of 2 went over the budget" in shown
    # the effective batch never changed: the loss curve is the one of 1 process with 8 examples
    assert losses(result) == pytest.approx(losses(full_runs[1]), rel=1e-5)


@pytest.mark.slow
@pytest.mark.long
def test_a_failing_worker_fails_the_command_and_leaves_no_process(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from memtrain.cli.app import app

    data = tmp_path / "no_text.jsonl"  # the `text` column is missing: only the workers read the data
    data.write_text("\n".join(json.dumps({"body": f"row {i}"}) for i in range(8)), encoding="utf-8")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(causal_recipe(tmp_path, data)), encoding="utf-8")
    marker = f"memtrain-test-{uuid.uuid4()}"
    monkeypatch.setenv("MEMTRAIN_TEST_MARKER", marker)  # inherited by every process it starts
    result = CliRunner().invoke(app, ["train", str(recipe), "--nproc", "2"])
    shown = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == 2, shown
    assert "`data.text_column`: is not a column of the data, got 'text'" in shown
    assert "(in training process" in shown
    assert "Traceback" not in shown  # a user mistake: the message, not a stack
    assert not [p for p in psutil.process_iter() if _environ(p).get("MEMTRAIN_TEST_MARKER") == marker]


def _environ(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}


# ------------------------------------------------ the planner shards when one replica does not fit

BUDGET = "130MiB"  # one process of the recipe below needs 141 MiB (measured in the test)


@pytest.mark.slow
def test_plan_picks_sharding_under_a_budget_and_every_rank_stays_under_it(tmp_path: Path) -> None:
    """docs/planner.md, "Several processes": a budget below one replica's step, above one shard's."""
    from typer.testing import CliRunner

    from memtrain.cli.app import app
    from memtrain.estimator.real_step import measure_recipe_step
    from memtrain.model import build_config
    from memtrain.run.train import train

    # Examples of 32 token ids packed two to a 64-token row: every row full, laid out as the
    # estimate's batch (block-diagonal attention), so each step is the estimated worst case.
    rows = [{"input_ids": [1000 + (i * 7 + j) % 5000 for j in range(32)]} for i in range(64)]
    data = tmp_path / "halves.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    recipe = causal_recipe(
        tmp_path, data, model={"from_config": {**TINY_CONFIGS["llama"], "hidden_size": 128,
                                               "tie_word_embeddings": False}},
        adapter={"method": "full"}, data={"max_length": 64, "format": "tokenized", "packing": True},
        training={"micro_batch_size": 2, "max_steps": 2}, distributed={"processes": 2, "sharding": "auto"})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    one = load_recipe(merge(recipe, {"distributed": {"processes": 1, "sharding": "none"}}))
    replica = measure_recipe_step(one, build_config(one.model)).peak_bytes
    assert replica > parse_size(BUDGET)  # measured: one process's step does not fit

    shown = CliRunner().invoke(app, ["plan", str(path), "distributed.processes=2",
                                     "distributed.sharding=auto", "--budget", BUDGET])
    assert shown.exit_code == 0, shown.output
    assert "sharding=full" in " ".join(shown.output.split())

    # held to the simulated budget, planned with the margin of the plan above (a real budget's)
    result = train(load_recipe(path, [f"memory.budget={BUDGET}", f"memory.simulate_budget={BUDGET}",
                                      "memory.margin=0.1"]))
    assert "FSDP2 over 2 processes (sharding full)" in result.patches[-1]
    assert not any("memory/recovered_micro_batch" in h for h in result.log_history)
    cfg = load_recipe(yaml.safe_load((result.output_dir / "recipe.yaml").read_text()))
    predicted = estimate(cfg).total_bytes
    assert len(result.process_memory) == 2
    for measured in result.process_memory:  # every rank, its step with the highest peak
        assert measured.peak_bytes <= parse_size(BUDGET)
        assert measured.peak_bytes == pytest.approx(predicted, rel=1e-3)
