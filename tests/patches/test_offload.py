"""Activation offload and optimizer-state offload: same training, bytes moved to the host."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from memtrain._compat import torch_tools
from memtrain.config import OffloadConfig, load_recipe
from memtrain.errors import MemtrainError
from memtrain.patches import activation_offload as offload
from memtrain.patches import apply_patches, records
from memtrain.patches import checkpointing as ckpt
from memtrain.trainer.optimizer_offload import OffloadOptimizer, build, host_bytes_needed
from scripts.probes.memprobe import LiveBytes
from tests.conftest import TINY_CONFIGS, causal_recipe
from tests.patches.test_checkpointing import BATCH, SEQ, assert_same_grads, build_model, inputs

HIDDEN = TINY_CONFIGS["llama"]["hidden_size"]
ON = OffloadConfig(activations=True, min_tensor_bytes=1024)


def offloaded(base: nn.Module, checkpointing: Any = "none", cfg: OffloadConfig = ON) -> nn.Module:
    return offload.apply(ckpt.apply(copy.deepcopy(base), checkpointing), cfg)


def measured_step(model: nn.Module) -> dict[str, Any]:
    """Loss, grads, device bytes saved by forward, and host bytes (at peak, after backward), counted
    by memprobe (host: what saved-tensor pack hooks made), not by the offload ledger."""
    with LiveBytes() as tracker:
        loss = model(**inputs()).loss
        saved, host_after_forward = tracker.device_current, tracker.host_current
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads, "saved": saved, "host": host_after_forward,
            "host_left": tracker.host_current, "device_peak": tracker.device_peak}


# ------------------------------------------------------------------------- activation offload


@pytest.mark.parametrize("checkpointing", ["none", "full", 1, "selective"])
def test_offload_keeps_gradients_and_moves_bytes_to_host(checkpointing: Any) -> None:
    base = build_model(layers=2)
    plain = measured_step(ckpt.apply(copy.deepcopy(base), checkpointing))
    moved = measured_step(offloaded(base, checkpointing))
    assert_same_grads(moved, plain)
    assert moved["host"] > 0 and moved["host_left"] == 0  # host copies die with the graph
    assert moved["saved"] <= plain["saved"] - moved["host"] // 2


def test_offload_without_checkpointing_moves_most_saved_bytes() -> None:
    base = build_model(layers=2)
    plain, moved = measured_step(copy.deepcopy(base)), measured_step(offloaded(base))
    assert moved["saved"] + moved["host"] >= plain["saved"] * 0.95
    assert moved["saved"] < 0.5 * plain["saved"]


def test_a_selective_checkpoint_keeps_its_matmul_outputs_on_the_device_on_any_torch() -> None:
    """A selective checkpoint keeps its matmul outputs outside autograd's saved tensors, on the
    device under an offload, as the estimator traces it. torch 2.14 and 2.15 ask to be told (a FutureWarning
    per checkpointed layer: a later release routes them through the offload's hooks) and fails the
    recompute when told to route them; memtrain tells it not to. (Planted on 2.15: nothing told
    -> the warning fails this; ``True`` told -> the recompute fails; on 2.13 the argument told
    where the signature lacks it -> test_checkpoint_is_told_only_where_it_can_be.)"""
    base = build_model(layers=2)
    plain = measured_step(ckpt.apply(copy.deepcopy(base), "selective"))
    model = offloaded(base, "selective")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saved_tensors_hooks context")
        moved = measured_step(model)
    assert_same_grads(moved, plain)
    assert moved["host"] > 0 and moved["saved"] > 0.5 * plain["saved"], (moved, plain["saved"])


def test_checkpoint_is_told_only_where_it_can_be(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's checkpoint passes keyword arguments it does not know to the checkpointed function
    (a layer's forward, which may swallow them): the argument goes only where the signature has it."""
    from torch.utils import checkpoint as torch_checkpoint

    def old(function: Any, *args: Any, use_reentrant: bool | None = None, **kwargs: Any) -> Any:
        return None

    def new(function: Any, *args: Any, use_reentrant: bool | None = None,
            respect_saved_tensors_hooks: bool | None = None, **kwargs: Any) -> Any:
        return None

    for fake, expected in ((old, {}), (new, {"respect_saved_tensors_hooks": False})):
        monkeypatch.setattr(torch_checkpoint, "checkpoint", fake)
        torch_tools.selective_checkpoint_options.cache_clear()
        assert torch_tools.selective_checkpoint_options() == expected
    monkeypatch.undo()
    torch_tools.selective_checkpoint_options.cache_clear()


def test_checkpointing_with_offload_is_flat_in_depth() -> None:
    """Only layer inputs are saved, and they move: device activations do not grow with depth."""
    two = measured_step(offloaded(build_model(layers=2), "full"))
    four = measured_step(offloaded(build_model(layers=4), "full"))
    hidden_state = BATCH * SEQ * HIDDEN * 4
    assert two["host"] == 2 * hidden_state and four["host"] == 4 * hidden_state
    assert four["saved"] == two["saved"]
    # The device peak grows only by the gradients of the extra layers' weights.
    model = build_model(layers=4)
    layer_bytes = sum(p.numel() * 4 for p in ckpt.find_layers(model)[0][1].parameters())
    assert four["device_peak"] - two["device_peak"] == 2 * layer_bytes
    plain_two = measured_step(ckpt.apply(build_model(layers=2), "full"))
    plain_four = measured_step(ckpt.apply(build_model(layers=4), "full"))
    assert plain_four["saved"] - plain_two["saved"] == 2 * hidden_state


def test_min_tensor_bytes_keeps_small_tensors() -> None:
    base = build_model(layers=2)
    huge = OffloadConfig(activations=True, min_tensor_bytes=2**30)
    assert measured_step(offloaded(base, cfg=huge))["host"] == 0
    hidden_state = BATCH * SEQ * HIDDEN * 4
    just_above = OffloadConfig(activations=True, min_tensor_bytes=hidden_state + 1)
    small = measured_step(offloaded(base, cfg=just_above))["host"]
    assert 0 < small < measured_step(offloaded(base))["host"]


def test_offload_with_lora_and_eval() -> None:
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(build_model(), LoraConfig(r=4, target_modules="all-linear",
                                                    lora_dropout=0.0))
    plain = measured_step(copy.deepcopy(lora))
    model = offloaded(lora, "full")
    assert_same_grads(measured_step(model), plain)
    model.eval()
    with torch.no_grad():
        model(**inputs())
    assert offload.host_ledger(model).current_bytes == 0


def test_dry_run_estimate_bounds_what_moves() -> None:
    for checkpointing in ("none", "full"):
        model = offloaded(build_model(layers=2), checkpointing)
        estimate = offload.estimate_offloaded_bytes(model, BATCH, SEQ)
        # Fake inputs cannot show that the attention mask is all ones, so the estimate also
        # counts a 4-D mask: an upper bound, close to what really moves.
        actual = measured_step(model)["host"]
        assert actual <= estimate <= 1.1 * actual


def test_host_ram_check_refuses_with_the_numbers() -> None:
    model = offloaded(build_model(layers=2), "full")
    needed = offload.check_host_ram(model, BATCH, SEQ, available=2**40)
    assert needed == 2 * BATCH * SEQ * HIDDEN * 4
    expected = r"memory\.offload\.activations.*32\.00 KiB.*16\.00 KiB"
    with pytest.raises(MemtrainError, match=expected):
        offload.check_host_ram(model, BATCH, SEQ, available=16 * 2**10)


def test_host_ram_check_counts_layer_inputs_when_the_forward_cannot_be_traced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's fake mode refuses bitsandbytes' 4-bit weights (seen on an H100): the check then
    counts the checkpointed layers' inputs, what full checkpointing moves, and says so."""
    traced = offload.estimate_offloaded_bytes(offloaded(build_model(layers=2), "full"), BATCH, SEQ)

    class Refusing:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> None:
            raise TypeError("Multiple dispatch failed for 'torch._ops.aten.view.default'")

        def __exit__(self, *exc: Any) -> None:
            pass

    monkeypatch.setattr(offload, "FakeTensorMode", Refusing)
    with pytest.warns(UserWarning, match=r"could not trace the forward \(TypeError: Multiple dispatch.*"
                                         r"inputs of the 2 checkpointed layers instead\.$"):
        counted = offload.estimate_offloaded_bytes(offloaded(build_model(layers=2), "full"), BATCH, SEQ)
    assert counted == traced == 2 * BATCH * SEQ * HIDDEN * 4
    with pytest.warns(UserWarning, match="its 2 layers that are not checkpointed are not counted"):
        assert offload.estimate_offloaded_bytes(offloaded(build_model(layers=2)), BATCH, SEQ) == 0


def test_recipe_hook_and_undo(tmp_path: Any, tiny_text_file: Any) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file,
                           memory={"checkpointing": "full", "offload": {"activations": True}})
    model = apply_patches(build_model(), load_recipe(recipe), only=["checkpointing", "offload"])
    assert [r.name for r in records(model)] == ["checkpointing", "activation_offload"]
    assert "inputs of 2 checkpointed layers" in records(model)[1].detail
    offload.undo(model)
    assert offload.offloader(model) is None
    assert all(ckpt.is_checkpointed(layer) for _, layer in ckpt.find_layers(model))
    auto = causal_recipe(tmp_path, tiny_text_file, memory={"offload": {"activations": "auto"}})
    with pytest.raises(MemtrainError, match="auto"):
        apply_patches(build_model(), load_recipe(auto), only=["offload"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_uses_pinned_memory_and_matches() -> None:
    base = build_model(layers=2).cuda()
    batch = {k: v.cuda() for k, v in inputs().items()}
    plain = copy.deepcopy(base)
    plain(**batch).loss.backward()
    model = offloaded(base, "full")
    loss = model(**batch).loss
    hooks = offload.offloader(model)
    assert hooks._handles and all(h.host.is_pinned() for h in hooks._handles.values())
    loss.backward()
    torch.cuda.synchronize()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


# -------------------------------------------------------------------------- optimizer offload


def _train(model: nn.Module, optimizer: Any, steps: int = 3, accumulate: int = 1,
           clip: float | None = None) -> list[float]:
    losses = []
    for _ in range(steps):
        for _ in range(accumulate):
            loss = model(**inputs()).loss
            loss.backward()
        losses.append(loss.item())
        if clip is not None:
            if isinstance(optimizer, OffloadOptimizer):
                optimizer.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        model.zero_grad()
    return losses


@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, None), (1, 1e-3)])
def test_offloaded_adamw_trains_like_adamw(accumulate: int, clip: float | None) -> None:
    base = build_model(layers=1)
    plain, moved = copy.deepcopy(base), copy.deepcopy(base)
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    reference = torch.optim.AdamW(plain.parameters(), fused=True, **kwargs)
    optimizer = OffloadOptimizer(moved.parameters(), torch.optim.AdamW, **kwargs)
    assert optimizer.d_opt is not None and optimizer.param_d2h_map  # both kinds exercised
    expected = _train(plain, reference, accumulate=accumulate, clip=clip)
    assert _train(moved, optimizer, accumulate=accumulate, clip=clip) == pytest.approx(expected,
                                                                                      abs=1e-5)
    for p, q in zip(moved.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_optimizer_state_lives_on_the_host() -> None:
    model = build_model(layers=1)
    optimizer = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    _train(model, optimizer, steps=1)
    moved = list(optimizer.param_d2h_map)
    param_bytes = sum(p.numel() * p.element_size() for p in moved)
    # a copy of each parameter and its gradient, AdamW's two moments and its step counters
    steps = 4 * len(moved)
    assert optimizer.host_bytes() == 4 * param_bytes + steps
    assert optimizer.host_bytes() == host_bytes_needed(list(model.parameters()),
                                                       torch.optim.AdamW) + steps
    assert len(optimizer.state) == len(moved) + len(optimizer.d_opt.state)  # what trackers read
    host_ids = {id(t.untyped_storage()) for t in optimizer.host_tensors()}
    assert not host_ids & {id(p.untyped_storage()) for p in moved}
    state = optimizer.state_dict()
    fresh = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["offloaded"][0]["state"][0]["step"] == 1
    # torchao's own param_groups go stale for on-device params after load_state_dict, so an LR
    # scheduler would stop reaching them; memtrain's subclass returns the live groups.
    assert any(g is fresh.d_opt.param_groups[0] for g in fresh.param_groups)


def test_build_refuses_8bit_and_small_host_ram() -> None:
    model = build_model(layers=1)
    groups = [{"params": list(model.parameters())}]
    with pytest.raises(MemtrainError, match=r"memory\.offload\.optimizer.*host RAM"):
        build(groups, torch.optim.AdamW, {"lr": 1e-3}, available=2**20)
    with pytest.raises(MemtrainError, match=r"the `memory\.host_budget` \(1MiB\) is 1\.00 MiB.*Fix: raise"):
        build(groups, torch.optim.AdamW, {"lr": 1e-3}, 2**20, "`memory.host_budget` (1MiB)")
    fake_bnb = type("AdamW8bit", (torch.optim.AdamW,), {"__module__": "bitsandbytes.optim"})
    with pytest.raises(MemtrainError, match="bitsandbytes"):
        build(groups, fake_bnb, {"lr": 1e-3})


@pytest.mark.slow
def test_trainer_with_offloaded_optimizer_keeps_the_loss_curve(tmp_path: Any,
                                                               tiny_text_file: Any) -> None:
    """Full fine-tuning with clipping: offloaded optimizer and activations = plain, per step."""
    from transformers import TrainerCallback

    from memtrain.run.train import train

    class Logs(TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[tuple[float, float]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.seen.append((logs["loss"], logs["grad_norm"]))

    def run(name: str, **memory: Any) -> list[tuple[float, float]]:
        recipe = causal_recipe(tmp_path / name, tiny_text_file, memory=memory,
                               adapter={"method": "full"},
                               training={"max_grad_norm": 0.5, "max_steps": 4})
        logs = Logs()
        train(load_recipe(recipe), callbacks=[logs])
        return logs.seen

    plain = run("plain")
    moved = run("offload", offload={"optimizer": True, "activations": True},
                checkpointing="full")
    assert len(plain) == 4 and all(norm > 0.5 for _, norm in plain)  # clipping is active
    assert [loss for loss, _ in moved] == pytest.approx([loss for loss, _ in plain], abs=1e-4)


def test_qlora_offload_keeps_gradients_and_estimates() -> None:
    pytest.importorskip("bitsandbytes")
    from memtrain.config import AdapterConfig, ModelConfig
    from memtrain.model import load_model
    from memtrain.patches import lora

    cfg = ModelConfig(from_config={**TINY_CONFIGS["llama"], "vocab_size": 256},
                      tokenizer="x", quantization="nf4", dtype="fp32")
    model = lora.apply(load_model(cfg), AdapterConfig(r=4, dropout=0.0)).train()
    plain = measured_step(model)
    model.zero_grad()
    patched = offload.apply(ckpt.apply(model, "full"), ON)
    assert offload.estimate_offloaded_bytes(patched, BATCH, SEQ) == 2 * BATCH * SEQ * HIDDEN * 4
    moved = measured_step(patched)
    assert_same_grads(moved, plain, atol=1e-5)
    assert moved["host"] == 2 * BATCH * SEQ * HIDDEN * 4


def test_memory_meter_files_offloaded_bytes_as_host() -> None:
    """memtrain's MemoryMeter: moved activations and the offloaded optimizer count as host."""
    from memtrain.trainer.step import measure_step

    base = build_model(layers=2)
    plain = measure_step(ckpt.apply(copy.deepcopy(base), "full"), inputs())
    model = offloaded(base, "full")
    moved = measure_step(model, inputs())
    hidden_states = 2 * BATCH * SEQ * HIDDEN * 4
    assert moved.host_peak_bytes == offload.host_ledger(model).peak_bytes == hidden_states
    activations = plain.max_by_category["activations"] - moved.max_by_category["activations"]
    assert activations == hidden_states
    assert plain.peak_by_phase["forward"] - moved.peak_by_phase["forward"] == hidden_states

    model = build_model(layers=1)
    optimizer = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    measure_step(model, inputs(), optimizer)  # creates the state
    steady = measure_step(model, inputs(), optimizer)
    assert steady.host_peak_bytes == optimizer.host_bytes()
    device_state = sum(v.numel() * v.element_size() for s in optimizer.d_opt.state.values()
                       for v in s.values())
    assert steady.peak_by_category["optimizer_state"] == device_state
    assert device_state < 0.1 * optimizer.host_bytes()


def test_dropped_gradients_skip_the_step() -> None:
    """The NaN guard drops a step's gradients before the step: host copies must not be used."""
    model = build_model(layers=1)
    optimizer = OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model(**inputs()).loss.backward()
    model.zero_grad(set_to_none=True)
    optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_the_trainer_checks_the_offloaded_optimizer_against_the_host_budget(tmp_path: Any,
                                                                           tiny_text_file: Any) -> None:
    """The optimizer offload's RAM check uses `memory.host_budget`, as activation offload's does
    (it used the free RAM whatever the recipe said)."""
    from memtrain.trainer.trainer import trainer_options

    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file,
                                    memory={"offload": {"optimizer": True}, "host_budget": "3MiB"}))
    assert trainer_options(cfg)["host_budget"] == (3 * 2**20, "`memory.host_budget` (3MiB)")
    plain = load_recipe(causal_recipe(tmp_path, tiny_text_file))
    assert trainer_options(plain)["host_budget"] is None


def test_a_cuda_estimate_holds_the_prefetched_copies(tmp_path: Any, tiny_text_file: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, backward brings the two tensors before the one it unpacks back ahead of need; a CPU
    trace never ran that path, and the H200 (2026-12-04) peaked 264.6 MB over its estimate at
    64,768 tokens of a 317M Llama, two layer inputs. A trace for CUDA now allocates them as the GPU
    does (a CPU run prefetches nothing: its estimate is unchanged)."""
    import memtrain

    model = {"from_config": {**TINY_CONFIGS["llama"], "vocab_size": 512, "num_hidden_layers": 4}}
    recipe = causal_recipe(tmp_path, tiny_text_file, model=model, data={"max_length": 256},
                           memory={"checkpointing": "full", "loss": "chunked",
                                   "offload": {"activations": True, "min_tensor_bytes": 1024}})
    with_prefetch = memtrain.estimate(recipe, device="cuda").peak_bytes
    cpu = memtrain.estimate(recipe, device="cpu").peak_bytes
    monkeypatch.setattr(offload, "traced_for_cuda", lambda: False)
    without = memtrain.estimate(recipe, device="cuda").peak_bytes
    layer_input = 4 * 256 * TINY_CONFIGS["llama"]["hidden_size"] * 4  # micro-batch x tokens x hidden, fp32
    assert 0 < with_prefetch - without <= 2 * layer_input
    assert cpu == without


def test_a_cuda_estimate_holds_each_offloaded_copy_at_the_power_of_two_cuda_pins(
        tmp_path: Any, tiny_text_file: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's pinned-memory allocator rounds every block up to a power of two (the 1.24B's
    376 MB layer inputs at 91,904 tokens pin 537 MB each: 8.0 GiB of host memory, not 5.6): a
    trace for CUDA counts each offloaded copy so; a CPU trace, where nothing is pinned, at its size.
    Both against the sizes the ledger was handed, every layer traced."""
    import memtrain
    from memtrain.memory.trackers import pinned_bytes

    assert [pinned_bytes(n) for n in (1, 1024, 1025, 376_438_784)] == [1, 1024, 2048, 536_870_912]
    sizes: list[tuple[int, bool]] = []
    add = offload.HostLedger.add

    def spy(self: Any, tensor: torch.Tensor, pinned: bool = False) -> None:
        sizes.append((tensor.untyped_storage().nbytes(), pinned))
        add(self, tensor, pinned)

    monkeypatch.setattr(offload.HostLedger, "add", spy)
    model = {"from_config": {**TINY_CONFIGS["llama"], "vocab_size": 512, "num_hidden_layers": 3}}
    recipe = causal_recipe(tmp_path, tiny_text_file, model=model, data={"max_length": 200},
                           memory={"checkpointing": "full", "loss": "chunked",
                                   "offload": {"activations": True, "min_tensor_bytes": 1024}})
    on_cpu = memtrain.estimate(recipe, device="cpu", exact=True)
    cpu = on_cpu.host_peak_bytes
    assert sizes and not any(p for _, p in sizes) and cpu == sum(n for n, _ in sizes)
    assert any(pinned_bytes(n) != n for n, _ in sizes)  # 200 tokens: not a power of two
    sizes.clear()
    on_cuda = memtrain.estimate(recipe, device="cuda", exact=True)
    cuda = on_cuda.host_peak_bytes
    assert sizes and all(p for _, p in sizes)
    assert cuda == sum(pinned_bytes(n) for n, _ in sizes) > cpu
    # what crosses to the host and back (the planner's cost model) is the tensors' bytes, not the
    # blocks' (counted rounded, the 8B plan for 8 GiB chose full checkpointing over none)
    assert on_cuda.host_moved_bytes == cpu - on_cpu.host_resident_bytes == sum(n for n, _ in sizes)


def test_the_prefetch_stand_in_keeps_the_layers_alike_for_the_depth_extrapolation(
        tmp_path: Any, tiny_text_file: Any) -> None:
    """The stand-in is one allocation at every unpack, so a CUDA estimate with activation offload is
    still extrapolated from short traces, and equals the trace of every layer (prefetching as the
    GPU does, two copies at the top layer and one per layer after, made the layers differ: a
    257,280-token plan then traced all 16 layers, 10 minutes)."""
    import memtrain

    model = {"from_config": {**TINY_CONFIGS["llama"], "vocab_size": 512, "num_hidden_layers": 8}}
    recipe = causal_recipe(tmp_path, tiny_text_file, model=model, data={"max_length": 128},
                           memory={"checkpointing": "full", "loss": "chunked",
                                   "offload": {"activations": True, "min_tensor_bytes": 1024}})
    fast = memtrain.estimate(recipe, device="cuda")
    full = memtrain.estimate(recipe, device="cuda", exact=True)
    assert "extrapolated" in fast.method, fast.method
    assert fast.peak_bytes == full.peak_bytes and fast.host_peak_bytes == full.host_peak_bytes
