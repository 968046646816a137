"""Bugs that were planted one at a time and that the rest of the suite let pass (issue 26, point 5).

Each test names the bug it guards in its docstring; each was checked by planting that bug, seeing
the test fail (the failure is quoted), and reverting. Tolerances live beside each case.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import causal_recipe, tiny_model
from torch import nn

from memtrain.config import FewBitConfig, load_recipe
from memtrain.patches import chunked_loss, fewbit
from memtrain.reliability.checkpoints import MANIFEST, STAGING, usable_checkpoint, verify
from memtrain.run.train import train

# ---------------------------------------------------------------------------- chunked loss


def _lm_batch(vocab: int = 512, rows: int = 3, tokens: int = 24) -> dict[str, torch.Tensor]:
    """Token ids with a padded row and a masked prompt (as tests/patches/test_chunked_loss.py's batch)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, tokens), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, :5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """The targets a causal LM's loss takes: labels shifted left by one, -100 appended."""
    return nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)


def _loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius-norm error of ``a`` relative to ``b``, in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("chunk", [None, 7])  # one chunk, and 11 chunks of 7 that do not divide 72
def test_chunked_loss_of_a_bf16_model_is_computed_in_fp32(chunk: int | None) -> None:
    """Guards: the chunked loss without its fp32 upcast (``transform(head(h))`` for
    ``transform(head(h).float())``). A bf16 Llama's loss became 6.25 instead of 6.2776; every other
    exactness test runs in fp32, where the upcast changes nothing.

    With the bug planted: ``Scalars are not close! Expected 6.288996219... but got 6.28125.
    Relative difference: 0.00123... (up to 1e-05 allowed)`` (chunks of 7; 0.0037 with one chunk).
    """
    model = tiny_model("llama").to(torch.bfloat16)
    batch = _lm_batch()
    with torch.no_grad():  # the standard loss, in fp32 from the model's own bf16 logits (HF upcasts)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert logits.dtype == torch.bfloat16
        reference = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                _shifted(batch["labels"]), ignore_index=-100)
        torch.testing.assert_close(model(**batch).loss, reference, rtol=1e-6, atol=0)  # HF's own
        loss = chunked_loss.apply(copy.deepcopy(model), chunk)(**batch).loss
    # measured 1.5e-7 relative (fp32 sums in another order); a bf16 loss is off by ~1e-3 (bf16
    # values near 6 are 2^-5 = 0.031 apart, 0.5%)
    torch.testing.assert_close(loss.float(), reference, rtol=1e-5, atol=0)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize(("chunk", "tolerance"), [
    (None, 0.003),  # one chunk: bit-equal to the standard path, measured 0.17% from fp32
    (7, 0.008),  # 11 chunks: measured 0.43% (each chunk's bf16 weight gradient summed in bf16)
])
def test_chunked_head_gradient_of_a_bf16_model_is_as_close_to_fp32_as_bf16_allows(
        chunk: int | None, tolerance: float) -> None:
    """The bf16 ``lm_head`` gradient, chunked and standard, against the same gradient computed in
    fp32 from the bf16 model's hidden states and head weight (the exact gradient of the bf16
    model's loss). Chunked and standard differ from each other by up to 0.8% (max) because each
    rounds to bf16 in other places: comparing them directly would need a tolerance that hides
    real errors, so each is held to its distance from the fp32 reference. A chunk dropped, counted
    twice or scaled wrongly moves the gradient by far more than 1%.
    """
    model = tiny_model("llama").to(torch.bfloat16)
    batch = _lm_batch()
    _, standard = _loss_and_grads(model, batch)
    _, chunked = _loss_and_grads(chunked_loss.apply(copy.deepcopy(model), chunk), batch)

    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
    weight = model.lm_head.weight.detach().float().requires_grad_()
    logits = hidden.detach().float().reshape(-1, hidden.shape[-1]) @ weight.T
    nn.functional.cross_entropy(logits, _shifted(batch["labels"]), ignore_index=-100).backward()
    exact = weight.grad

    assert chunked["lm_head.weight"].dtype == torch.bfloat16
    assert _relative(standard["lm_head.weight"], exact) < 0.003  # the reference is the right one
    error = _relative(chunked["lm_head.weight"], exact)
    assert error < tolerance, f"chunked lm_head gradient {error:.2%} from fp32 (allowed {tolerance:.1%})"


def _scaled_model(model_type: str, **scaling: float) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                  max_position_embeddings=256, **scaling)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize(("model_type", "scaling"), [
    ("granite", {"logits_scaling": 8.0}),  # divides (its default 1.0 would hide an inversion)
    ("cohere", {"logit_scale": 4.0}),  # multiplies (default 0.0625)
])
@pytest.mark.parametrize("chunk", [None, 7])
def test_logit_scaling_of_granite_and_cohere_matches_the_models_own_loss(
        model_type: str, scaling: dict, chunk: int | None) -> None:
    """Guards: Granite's ``logits_scaling`` applied the wrong way round (multiplied, not divided),
    and Cohere's ``logit_scale`` dropped or inverted: the module docstring claims both, and no test
    had a model that scales its logits. Loss and every gradient equal the model's own (fp32).

    With Granite's scaling inverted: ``Expected 6.2431... but got 7.3320... Relative difference:
    0.174... (up to 1e-05 allowed)``; with Cohere's dropped: ``Expected 6.6486... but got 6.2816...
    Relative difference: 0.0552...``.
    """
    model = _scaled_model(model_type, **scaling)
    batch = _lm_batch()
    loss, grads = _loss_and_grads(model, batch)
    patched_loss, patched_grads = _loss_and_grads(chunked_loss.apply(copy.deepcopy(model), chunk), batch)
    torch.testing.assert_close(patched_loss, loss, rtol=1e-5, atol=0)  # as tests/patches/test_chunked_loss.py
    assert patched_grads.keys() == grads.keys()
    for name, grad in grads.items():
        scale = grad.abs().max().clamp_min(1e-12)
        err = float((patched_grads[name] - grad).abs().max() / scale)
        assert err < 1e-5, f"{name}: relative gradient error {err:.2e}"


# ----------------------------------------------------------------------------- checkpoints


def test_the_manifest_is_written_and_synced_inside_the_staged_folder_before_it_is_published(
        tmp_path: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Guards: the checkpoint manifest written after the folder is published (renamed from
    ``.staging``), without fsync. A power loss then leaves a published checkpoint without its
    manifest, or with a manifest the disk never got; tests/reliability/test_reliability.py's sync test calls
    :func:`publish` on a folder it staged itself, so it cannot see where the Trainer's save puts
    the manifest. Here a real run saves, and every ``fsync`` and rename is recorded.

    With the bug planted: ``AssertionError: checkpoint-2 was published without
    memtrain_manifest.json in the staged folder``.
    """
    events: list[tuple] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        status = os.fstat(fd)
        events.append(("fsync", (status.st_dev, status.st_ino), status.st_size))
        real_fsync(fd)

    def moving(real: Any) -> Any:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            manifest = Path(src) / MANIFEST
            found = manifest.stat() if manifest.is_file() else None
            events.append(("publish", Path(src), Path(dst), _node(Path(src)),
                           found and (found.st_dev, found.st_ino), found and found.st_size))
            return real(src, dst, *args, **kwargs)
        return move

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", moving(real_rename))  # Path.rename calls os.rename
    monkeypatch.setattr(os, "replace", moving(real_replace))
    recipe = causal_recipe(tmp_path, tiny_text_file,
                           training={"max_steps": 2, "save_strategy": "steps", "save_steps": 2})
    started = time.time()
    with caplog.at_level(logging.WARNING):
        train(load_recipe(recipe))
    elapsed = time.time() - started
    monkeypatch.undo()
    assert "NaN or infinite" not in caplog.text  # finite weights are not reported as NaN

    published = [(i, e) for i, e in enumerate(events)
                 if e[0] == "publish" and re.fullmatch(r"checkpoint-\d+", e[2].name)]
    assert [e[2].name for _, e in published] == ["checkpoint-2"]
    for i, (_, staged, final, folder, manifest, size) in published:
        assert STAGING in staged.parts, f"{final.name} was not written into {STAGING}"
        assert manifest is not None, f"{final.name} was published without {MANIFEST} in the staged folder"
        synced = [j for j, e in enumerate(events[:i]) if e[0] == "fsync" and e[1] == manifest]
        assert synced, f"{final.name}: {MANIFEST} was never fsync'ed before the folder was published"
        assert events[synced[-1]][2] == size, f"{final.name}: {MANIFEST} changed after its fsync"
        assert any(e[0] == "fsync" and e[1] == folder for e in events[synced[-1]:i]), \
            f"{final.name}: the staged folder (its entry for {MANIFEST}) was not fsync'ed after it"
        assert any(e[0] == "fsync" and e[1] == _node(final.parent) for e in events[i:]), \
            f"{final.name}: the parent folder was not fsync'ed after the rename"
        written = json.loads((final / MANIFEST).read_text(encoding="utf-8"))
        assert written["step"] == 2 and written["finite"] is True
        assert 0 < written["train_runtime"] < elapsed
        assert set(written["files"]) == {p.relative_to(final).as_posix() for p in final.rglob("*")
                                         if p.is_file() and p.name != MANIFEST}
        assert verify(final) is None
    (final / MANIFEST).unlink()  # what a power loss leaves when the manifest comes after the rename
    assert verify(final) == f"{MANIFEST} is missing or unreadable (not a complete memtrain save: it is " \
                            "written before a checkpoint is published)"
    assert usable_checkpoint(final.parent)[0] is None


def _node(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_dev, status.st_ino


# ---------------------------------------------------------------------------- few-bit backward


class _AliasingGelu(nn.Module):
    """A GELU that writes its output over its input and returns it (the input's storage)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(nn.functional.gelu(x))


@pytest.mark.parametrize(("inplace", "plain", "function"), [
    (lambda: nn.SiLU(inplace=True), nn.SiLU, "silu"),
    (_AliasingGelu, nn.GELU, "gelu"),
])
def test_an_activation_that_overwrites_its_input_gets_the_gradients_of_its_input(
        inplace: Any, plain: Any, function: str) -> None:
    """Guards: the few-bit code taken after an in-place activation ran, i.e. of its output instead
    of its input (553 of 1,001 SiLU gradients wrong). The in-place test in tests/patches/test_fewbit.py uses
    ReLU, which maps every negative input to 0, the boundary its 1-bit table puts negatives under:
    its codes are the same either way.

    With the bug planted: ``AssertionError: 569 of 1001 gradients differ from the out-of-place
    activation's`` (SiLU), ``562 of 1001 ...`` (the aliasing GELU).
    """
    from memtrain.patches.fewbit import FewBitActivation

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weight = torch.linspace(-1, 1, 1001)  # a gradient that differs per element

    def grad_of(act: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        y = act(x * 1.0)  # a non-leaf input, as inside a model
        (y * weight).sum().backward()
        return y.detach(), x.grad.clone()

    out, grad = grad_of(FewBitActivation(inplace(), function, 3))
    expected_out, expected = grad_of(FewBitActivation(plain(), function, 3))
    assert torch.equal(out, expected_out)
    wrong = int((grad != expected).sum())
    assert wrong == 0, f"{wrong} of {x.numel()} gradients differ from the out-of-place activation's"
    # and through fewbit.apply, which identifies the in-place module as the activation it computes
    model = fewbit.apply(nn.Sequential(nn.Identity(), inplace()), FewBitConfig(bits=3, targets=["1"]))
    assert torch.equal(grad_of(model)[1], expected)


def _used_tables(model: nn.Module, monkeypatch: pytest.MonkeyPatch,
                 ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """The boundaries and levels the few-bit layers actually encode and decode with in one step,
    and the step's gradients."""
    boundaries: list[torch.Tensor] = []
    levels: list[torch.Tensor] = []
    real_encode, real_decode = fewbit.encode, fewbit.decode_mul

    def encode(x: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
        boundaries.append(b.clone())
        return real_encode(x, b, bits)

    def decode_mul(grad: torch.Tensor, packed: torch.Tensor, v: torch.Tensor, bits: int) -> torch.Tensor:
        levels.append(v.clone())
        return real_decode(grad, packed, v, bits)

    monkeypatch.setattr(fewbit, "encode", encode)
    monkeypatch.setattr(fewbit, "decode_mul", decode_mul)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    monkeypatch.undo()
    return boundaries, levels, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("dtype", "cast"), [
    (torch.bfloat16, lambda m: m.to(torch.bfloat16)),
    (torch.float16, lambda m: m.half()),
    (torch.bfloat16, lambda m: m.bfloat16()),
])
def test_casting_a_patched_model_leaves_its_few_bit_tables_alone(
        dtype: torch.dtype, cast: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards: the few-bit boundaries and levels kept as floating buffers, which ``model.to(bf16)``
    (or ``.half()``) casts: the boundaries move (3-bit SiLU: 1.12 becomes 1.1171875 in bf16) and
    inputs between the old and the new boundary get the neighbouring level.

    After the cast, the tables used are the fp32 tables used before it, bit for bit, and the
    gradients equal (exactly) those of a model cast first and patched after.

    With the bug planted: ``AssertionError: the boundaries used changed with the cast`` (all three
    casts).
    """
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    config = FewBitConfig(bits=3)
    patched = fewbit.apply(tiny_model("llama"), config)
    before_b, before_l, _ = _used_tables(patched, monkeypatch, ids)
    assert len(before_b) == 2 and all(b.dtype == torch.float32 for b in before_b)  # one per layer
    after_b, after_l, grads = _used_tables(cast(patched), monkeypatch, ids)
    assert all(torch.equal(a, b) for a, b in zip(after_b, before_b, strict=True)), \
        "the boundaries used changed with the cast"
    assert all(torch.equal(a, b) for a, b in zip(after_l, before_l, strict=True)), \
        "the levels used changed with the cast"

    fresh = fewbit.apply(cast(tiny_model("llama")), config)
    _, _, expected = _used_tables(fresh, monkeypatch, ids)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.dtype == dtype
        assert torch.equal(grads[name], grad), name
