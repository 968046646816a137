"""The plugin chooses from the registry of techniques and applies them as training does (issue 36):
every patch knob registered with ``plugin=True`` is planned, the chosen patches go on the user's
model through the same ``apply_patches`` as ``memtrain train``, in the registry's stage order, and
the peak predicted for that model is the one a real ``transformers.Trainer`` step holds.

The model is a tiny Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``), a family neither the CLI nor
the end-to-end tests build; measured by ``scripts/probes/memprobe.py`` (no memtrain code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from plain_trainer import arguments, collate
from transformers import AutoConfig, AutoModelForCausalLM, Trainer

import memtrain
from memtrain import patches
from memtrain.errors import MemtrainError
from memtrain.plugin.apply import planned_fields
from memtrain.plugin.describe import patch_knobs, patch_names
from scripts.probes.memprobe import trainer_steps

VOCAB = 512
FORCED = {"tiled_mlp": True, "lean_norm": True,
          "offload": {"activations": True, "min_tensor_bytes": 1024}}  # tiny tensors move too
FORCED_PATCHES = {"tiled_mlp", "lean_norm", "activation_offload"}


def phi3() -> torch.nn.Module:
    config = AutoConfig.for_model("phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def rows(count: int, length: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(5, VOCAB, (length,), generator=gen).tolist()} for _ in range(count)]


def test_the_plugins_choices_are_the_registrys() -> None:
    """Every patch knob registered with ``plugin=True`` is planned (``auto``) unless fixed; a field the
    plugin cannot apply is refused before any planning."""
    registered = {k.path for t in patches.techniques() if t.hook is not None for k in t.knobs if k.plugin}
    assert {k.path for k in patch_knobs()} == registered
    assert {"memory.tiled_mlp", "memory.lean_norm", "memory.offload.activations", "memory.offload.embeddings",
            "memory.loss_chunk_tokens", "memory.tiled_mlp_tile_tokens"} <= registered
    assert patch_names() == [n for n in patches.available() if n in set(patch_names())]  # stage order
    assert "lora" not in patch_names()  # the user's model is its own adapter
    fields = planned_fields(None, user_checkpointing=False, margin=0.1, adapter_pending=False)
    assert all(fields[path] == "auto" for path in registered)
    fixed = planned_fields(FORCED, user_checkpointing=True, margin=0.1, adapter_pending=True)
    assert (fixed["memory.tiled_mlp"], fixed["memory.offload.activations"], fixed["memory.checkpointing"],
            fixed["memory.offload.embeddings"]) == (True, True, "full", False)
    with pytest.raises(MemtrainError, match=r"memory=\{'offload.optimizer': ...\}` is not a setting"):
        planned_fields({"offload": {"optimizer": True}}, False, 0.1, False)
    # a technique fixed off takes its size along (a tile size `auto` with the tiled MLP off was an
    # invalid recipe: prepare_for_budget(memory={"tiled_mlp": False}) raised a ValueError)
    off = planned_fields({"tiled_mlp": False, "loss": "standard"}, False, 0.1, False)
    assert (off["memory.tiled_mlp_tile_tokens"], off["memory.loss_chunk_tokens"]) == (None, None)
    sized = planned_fields({"tiled_mlp": False, "tiled_mlp_tile_tokens": 64}, False, 0.1, False)
    assert sized["memory.tiled_mlp_tile_tokens"] == 64  # fixed by the user: kept (the recipe says why not)


def test_forced_techniques_are_applied_in_stage_order_and_the_step_holds_the_prediction(
        tmp_path: Path) -> None:
    args = arguments(tmp_path, 4, 1, 3)
    model, new_args = memtrain.prepare_for_budget(phi3(), args, "400MiB", max_length=32, quiet=True,
                                                  memory=FORCED)
    plan = model.memtrain_plan
    applied = [r.name for r in patches.records(model)]
    # (a) the records name the forced techniques, in the registry's stage order
    assert set(applied) >= FORCED_PATCHES, applied
    assert applied == [n for n in patches.available() if n in set(applied)], applied
    assert (plan.settings["tiled_mlp"], plan.settings["lean_norm"], plan.settings["offload.activations"]) == (
        True, True, True)
    assert {c.setting for c in plan.changes} >= {"tiled_mlp", "lean_norm", "offload.activations"}
    # a re-run starts from the plain model: nothing nested
    model, new_args = memtrain.prepare_for_budget(model, args, "400MiB", max_length=32, quiet=True,
                                                  memory=FORCED)
    assert [r.name for r in patches.records(model)] == applied
    plan = model.memtrain_plan
    assert plan.settings["per_device_train_batch_size"] == new_args.per_device_train_batch_size
    # (b) a real Trainer's steps hold what the plan predicts (from the second step: optimizer state)
    trainer = Trainer(model=model, args=new_args, train_dataset=rows(12, 32), data_collator=collate)
    counter = trainer_steps()
    trainer.add_callback(counter)
    trainer.train()
    steady = [s for s in counter.steps if s["step"] >= 2]
    assert steady and all(s["host_peak"] > 0 for s in steady)  # the offload moved tensors
    # On a CPU the plan's peak is what the machine holds, device and host copies together (the
    # same RAM): memprobe's total. Measured as written: predicted 3,163,532, counted 3,065,228 (the
    # device part 2,532,748 both; the estimate's host copies are 98,304 bytes over the count).
    measured = max(s["total_peak"] for s in steady)
    print(f"phi3 plugin: predicted {plan.predicted_peak:,} measured {measured:,}")
    assert measured <= plan.predicted_peak <= 1.05 * measured, (plan.predicted_peak, counter.steps)
