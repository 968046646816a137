"""`memtrain train` end to end on tiny models: LoRA, QLoRA, 8-bit AdamW, accumulation, resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import causal_recipe
from transformers import TrainerCallback

from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.run.train import train


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    # short, repetitive lines: a tiny model's loss falls visibly in a few steps
    lines = [f"to be or not to be that is the question {i % 4}" for i in range(64)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in lines))
    return path


def losses(result) -> list[float]:
    return [h["loss"] for h in result.log_history if "loss" in h]


def test_lora_trains_only_adapters_and_loss_falls(tmp_path: Path, corpus: Path) -> None:
    cfg = load_recipe(causal_recipe(tmp_path, corpus, training={"max_steps": 12, "learning_rate": 1e-2}))
    result = train(cfg)
    trainable = [n for n, p in result.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    seen = losses(result)
    assert seen[-1] < seen[0] - 0.5
    out = result.output_dir
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "recipe.yaml",
                 "metrics.json"):
        assert (out / name).is_file(), name
    assert load_recipe(out / "recipe.yaml").training.max_steps == 12


class GradProbe(TrainerCallback):
    """Keeps a copy of the trainable gradients right before each optimizer step."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None})


@pytest.mark.slow
def test_qlora_grads_survive_an_eval_pass(tmp_path: Path, corpus: Path) -> None:
    import bitsandbytes as bnb

    probe = GradProbe()
    cfg = load_recipe(causal_recipe(tmp_path, corpus, model={"quantization": "nf4"},
                                    data={"eval_split": 0.25},
                                    training={"max_steps": 4, "eval_steps": 2}))
    result = train(cfg, callbacks=[probe])
    layers = [m for m in result.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.dtype == torch.uint8 for m in layers)  # 4-bit packed storage
    assert len(probe.grads) == 4
    after_eval = probe.grads[2]  # step 3 comes after the eval at step 2
    lora_grads = [g for n, g in after_eval.items() if "lora_" in n]
    assert lora_grads and all(g.abs().sum() > 0 for g in lora_grads)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_qlora_trains_a_sequence_classifier_with_its_head_in_full(
        tmp_path: Path, tiny_classification_file: Path, quantization: str) -> None:
    # transformers leaves unquantized the module named by the model's last parameter, which for a
    # classifier is `classifier.bias`: the head was quantized and the first step asserted inside
    # bitsandbytes (exit 1). The head must stay a float layer that peft trains in full.
    import bitsandbytes as bnb

    from memtrain.estimator.estimate import estimate

    probe = GradProbe()
    recipe = causal_recipe(tmp_path, tiny_classification_file, arch="bert",
                           model={"quantization": quantization, "task": "sequence-classification"},
                           data={"format": "classification"}, training={"max_steps": 2})
    cfg = load_recipe(recipe)
    assert estimate(cfg).peak_bytes > 0  # the fake build quantizes the same way
    result = train(cfg, callbacks=[probe])
    modules = dict(result.model.named_modules())
    assert any(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in modules.values())
    heads = {n: m for n, m in modules.items() if n.endswith("modules_to_save.default")}
    assert heads and all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
                         for m in heads.values())
    grads = probe.grads[-1]
    head_grads = [g for n, g in grads.items() if "modules_to_save" in n]
    lora_grads = [g for n, g in grads.items() if "lora_" in n]
    assert head_grads and lora_grads and all(g.abs().sum() > 0 for g in head_grads + lora_grads)


def test_8bit_adamw_keeps_uint8_state(tmp_path: Path, corpus: Path) -> None:
    captured = {}

    class Grab(TrainerCallback):
        def on_train_end(self, args, state, control, optimizer=None, **kwargs):
            captured["state"] = [v for s in optimizer.optimizer.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor)]

    cfg = load_recipe(causal_recipe(tmp_path, corpus, adapter={"method": "full"},
                                    training={"optimizer": "adamw_8bit", "max_steps": 2}))
    train(cfg, callbacks=[Grab()])
    dtypes = {t.dtype for t in captured["state"]}
    assert torch.uint8 in dtypes  # 8-bit moments for the large (>= 4096 element) tensors


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    # uneven lengths, so micro-batches are padded differently from the big batch
    lines = [" ".join(["word"] * (3 + i % 9)) + f" {i}" for i in range(32)]
    data = tmp_path / "uneven.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in lines))
    grads = []
    for micro, accum in ((8, 1), (2, 4)):
        probe = GradProbe()
        cfg = load_recipe(causal_recipe(tmp_path / f"{micro}x{accum}", data, training={
            "micro_batch_size": micro, "gradient_accumulation": accum, "max_steps": 1,
            "max_grad_norm": None}))
        train(cfg, callbacks=[probe])
        grads.append(probe.grads[0])
    big, small = grads
    assert big.keys() == small.keys() and big
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_accumulation_matches_for_classification(tmp_path: Path,
                                                          tiny_classification_file: Path) -> None:
    # Transformers 5 skips the 1/accumulation scaling for models whose forward takes **kwargs,
    # which sequence classifiers do although their loss is a plain mean: memtrain restores it.
    grads = []
    for micro, accum in ((8, 1), (2, 4)):
        probe = GradProbe()
        recipe = causal_recipe(tmp_path / f"{micro}x{accum}", tiny_classification_file, arch="bert",
                               training={"micro_batch_size": micro, "gradient_accumulation": accum,
                                         "max_steps": 1, "max_grad_norm": None})
        recipe["model"]["task"] = "sequence-classification"
        recipe["model"]["from_config"].update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        recipe["data"]["format"] = "classification"
        train(load_recipe(recipe), callbacks=[probe])
        grads.append(probe.grads[0])
    big, small = grads
    assert big.keys() == small.keys() and big
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-4, atol=1e-6, msg=name)


def test_resume_continues_at_the_saved_step(tmp_path: Path, corpus: Path) -> None:
    sections = {"training": {"max_steps": 6, "save_strategy": "steps", "save_steps": 3,
                             "save_total_limit": None}}
    full = train(load_recipe(causal_recipe(tmp_path / "a", corpus, **sections)))
    out = full.output_dir
    shutil.rmtree(out / "checkpoint-6")
    (out / "metrics.json").unlink()
    ran: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ran.append(state.global_step)

    resumed = train(load_recipe(causal_recipe(tmp_path / "a", corpus, **sections), ["training.resume=true"]),
                    callbacks=[Steps()])
    assert ran == [4, 5, 6]  # continued after the checkpoint at step 3; nothing redone
    by_step = {h["step"]: h["loss"] for h in full.log_history if "loss" in h}
    for h in resumed.log_history:
        if "loss" in h:  # same data order, optimizer and scheduler state: the same losses
            assert h["loss"] == pytest.approx(by_step[h["step"]], rel=1e-5), h["step"]


def test_refuses_to_overwrite_a_finished_run(tmp_path: Path, corpus: Path) -> None:
    cfg = load_recipe(causal_recipe(tmp_path, corpus, training={"max_steps": 1}))
    train(cfg)
    with pytest.raises(MemtrainError, match="already holds a finished run"):
        train(cfg)
