"""Chunked loss: same loss and gradients as the model's own, less memory, clear failures."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIGS, causal_recipe, tiny_model

from memtrain.config import RecipeError, load_recipe
from memtrain.errors import MemtrainError
from memtrain.patches import chunked_loss, records
from memtrain.plan.search import TraceCache
from scripts.probes.memprobe import LiveBytes

RTOL = 1e-5
CHUNK_TOKENS = "memory.loss_chunk_tokens"


def _batch(vocab: int = 512, rows: int = 3, tokens: int = 24) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, tokens), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # a padded row
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, :5] = -100  # a masked prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model: torch.nn.Module, batch: dict, **kwargs: object) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same dropout masks in both runs (GPT-2 has dropout)
    loss = model(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: tuple, b: tuple) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=RTOL, atol=0)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        scale = b[1][name].abs().max().clamp_min(1e-12)
        err = (a[1][name] - b[1][name]).abs().max() / scale
        assert err < RTOL, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {}),  # untied head
    ("gpt2", {}),  # head tied to the embedding
    ("qwen2", {"tie_word_embeddings": True}),
])
@pytest.mark.parametrize("chunk", [None, 7])  # Liger's rule, and chunks that do not divide the tokens
def test_loss_and_every_gradient_equal_the_models_own(arch: str, overrides: dict, chunk: int | None) -> None:
    model = tiny_model(arch, **overrides)
    batch = _batch()
    reference = _loss_and_grads(model, batch)
    patched = chunked_loss.apply(copy.deepcopy(model), chunk)
    _assert_same(_loss_and_grads(patched, batch), reference)


def test_num_items_in_batch_normalisation_matches_under_accumulation() -> None:
    """The Trainer passes the trained-token count of all accumulated micro-batches."""
    model = tiny_model("llama")
    batch = _batch()
    items = torch.tensor(97)
    reference = _loss_and_grads(model, batch, num_items_in_batch=items)
    patched = chunked_loss.apply(copy.deepcopy(model), 5)
    _assert_same(_loss_and_grads(patched, batch, num_items_in_batch=items), reference)


def test_logit_softcapping_is_applied_per_chunk() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  vocab_size=512, final_logit_softcapping=2.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    batch = _batch()
    reference = _loss_and_grads(model, batch)
    _assert_same(_loss_and_grads(chunked_loss.apply(copy.deepcopy(model), 8), batch), reference)


def test_under_lora_and_without_labels_the_model_is_unchanged() -> None:
    from memtrain.config import AdapterConfig
    from memtrain.patches import lora

    model = lora.apply(tiny_model("llama"), AdapterConfig(r=4, dropout=0.0))
    batch = _batch()
    reference = _loss_and_grads(model, batch)
    patched = chunked_loss.apply(copy.deepcopy(model))
    _assert_same(_loss_and_grads(patched, batch), reference)
    assert any(r.name == "chunked_loss" for r in records(patched))
    with torch.no_grad():  # generation path: logits as before
        plain = {k: v for k, v in batch.items() if k != "labels"}
        torch.testing.assert_close(patched(**plain).logits, model(**plain).logits)


def test_full_vocabulary_logits_never_exist() -> None:
    """Measured with an independent live-bytes counter: the step's peak drops by more than the
    three full fp32 logit copies the standard loss holds at once, minus one chunk."""
    model = tiny_model("llama", vocab_size=30522)
    batch = _batch(30522, rows=4, tokens=64)
    full_logits = 4 * 64 * 30522 * 4

    def peak(m: torch.nn.Module) -> int:
        m.zero_grad(set_to_none=True)
        with LiveBytes() as probe:
            m(**batch).loss.backward()
        return probe.device_peak

    standard = peak(model)
    chunked = peak(chunked_loss.apply(copy.deepcopy(model), 32))
    assert standard - chunked > 2 * full_logits, (standard, chunked)


def test_patching_twice_changes_nothing_and_undo_restores() -> None:
    model = tiny_model("llama")
    chunked_loss.apply(model)
    chunked_loss.apply(model)
    assert [r.name for r in records(model)] == ["chunked_loss"]
    records(model)[0].undo()
    assert "forward" not in model.__dict__


def test_models_without_a_decoder_and_head_are_refused() -> None:
    with pytest.raises(MemtrainError, match=r"memory.loss.*Fix: set `memory.loss: standard`"):
        chunked_loss.apply(tiny_model("bert"))


def test_chunk_rule() -> None:
    # Llama-3.1-8B: 4096 tokens, hidden 4096, vocabulary 128,256 -> 32 chunks of 128 tokens.
    assert chunked_loss.chunk_tokens(4096, 4096, 128256) == 128
    # a small model: at least 32 MiB of fp32 logits per chunk (275 tokens; evening out to 8 x 256
    # would go below that floor)
    assert chunked_loss.chunk_tokens(2048, 128, 30522) == 275


def test_recipe_for_a_classifier_is_refused() -> None:
    from memtrain.config import RecipeError, load_recipe

    recipe = {"model": {"name": "x", "task": "sequence-classification"},
              "data": {"source": "x.csv", "format": "classification"}, "memory": {"loss": "chunked"}}
    with pytest.raises(RecipeError, match=r"memory\.loss"):
        load_recipe(recipe)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_keeps_its_bf16_input_once_with_the_same_gradients(dropout: float) -> None:
    """peft would save an fp32 copy of every adapted layer's bf16 input (with dropout, the dropped
    copy and its mask); memtrain saves the input and recomputes the rest in backward.

    peft starts every ``lora_B`` at zero, and then every ``lora_A`` gradient is zero whatever the
    backward computes; so ``lora_B`` is set to seeded random values first, and the gradients of
    both (compared with peft's own forward and backward, which share no code with memtrain's) are
    checked to be non-zero."""
    from peft import LoraConfig, get_peft_model

    from memtrain.patches.lora import lean_lora_layers

    def run(lean: bool) -> tuple[dict, int]:
        model = tiny_model("llama", num_hidden_layers=2).to(torch.bfloat16)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                 target_modules="all-linear"))
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        if lean:
            assert lean_lora_layers(model) == 14  # 7 linear layers x 2 decoder layers
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(5)  # the same dropout masks in both runs
        with LiveBytes() as probe:
            model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, probe.device_peak

    (peft_grads, peft_peak), (lean_grads, lean_peak) = run(False), run(True)
    assert peft_grads.keys() == lean_grads.keys() and peft_grads
    for kind in ("lora_A", "lora_B"):
        mine = [name for name in peft_grads if kind in name]
        assert len(mine) == 14 and all(peft_grads[name].abs().max() > 0 for name in mine), kind
    for name, grad in peft_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert lean_peak < peft_peak, (lean_peak, peft_peak)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lean_lora_layers_match_peft_in_fp32_and_bf16(dropout: float) -> None:
    """Outputs and gradients of every LoRA weight equal peft's own forward (same dropout masks)."""
    from peft import LoraConfig, get_peft_model

    from memtrain.patches.lora import lean_lora_layers

    def run(lean: bool, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        model = tiny_model("llama").to(dtype)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                 target_modules="all-linear", init_lora_weights=False))
        if lean:
            lean_lora_layers(model)
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(5)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-6)):  # bit-equal when measured
        (ref_logits, ref_grads), (logits, grads) = run(False, dtype), run(True, dtype)
        torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol)
        for name, grad in ref_grads.items():
            scale = grad.abs().max().clamp_min(1e-12)
            assert ((grads[name] - grad).abs().max() / scale).item() < tol, name


# ------------------------------------------------ mutants that survived (docs/bench/mutation.md)


def test_every_labelled_token_counts_and_a_left_padded_row_is_masked() -> None:
    """Mutants that survived: the chunk loop starting at token 1 (the first token never trained)
    and the attention mask not passed to the decoder. Every batch above masks its first tokens and
    pads on the right, which a causal model never looks at; here every token is labelled and a row
    is padded on the left."""
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    reference = _loss_and_grads(model, batch)
    _assert_same(_loss_and_grads(chunked_loss.apply(copy.deepcopy(model), 7), batch), reference)


def test_decoder_arguments_and_outputs_pass_through() -> None:
    """Mutants that survived: the decoder called without the caller's other arguments (packed
    rows' position ids), the model's own forward (no labels) called without them, and the
    output's hidden states, attentions and cache dropped."""
    model = tiny_model("llama")
    model.set_attn_implementation("eager")  # attention weights are returned by eager attention only
    patched = chunked_loss.apply(copy.deepcopy(model), 7)
    batch = _batch()
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(3, 1)  # two packed examples
    extra = {"position_ids": positions, "output_hidden_states": True, "output_attentions": True}
    _assert_same(_loss_and_grads(patched, batch, **extra), _loss_and_grads(model, batch, **extra))
    with torch.no_grad():
        ours, theirs = patched(**batch, **extra), model(**batch, **extra)
        for name in ("hidden_states", "attentions"):
            assert len(getattr(ours, name)) == len(getattr(theirs, name)) > 0, name
            for a, b in zip(getattr(ours, name), getattr(theirs, name), strict=True):
                torch.testing.assert_close(a, b, msg=name)
        assert patched(**batch, use_cache=True).past_key_values is not None  # asked for, returned
        assert patched(**batch).past_key_values is None  # never built for training otherwise
        plain = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                 "position_ids": positions}
        torch.testing.assert_close(patched(**plain).logits, model(**plain).logits)


def test_a_mixture_of_experts_router_loss_is_refused_with_the_fix() -> None:
    """Mutants that survived: the router-loss check and every word of the refusals, also for
    modules that are not transformers models (no ``base_model_prefix``, no output head)."""
    with pytest.raises(MemtrainError) as err:
        chunked_loss.apply(tiny_model("mistral", model_type="mixtral", num_local_experts=2,
                                      num_experts_per_tok=1, output_router_logits=True))
    assert str(err.value) == ("`memory.loss`: this mixture-of-experts model adds its router loss to the "
                              "loss, which the chunked loss does not compute. Fix: set `memory.loss: "
                              "standard`.")
    with pytest.raises(MemtrainError) as err:
        chunked_loss.apply(tiny_model("bert"))
    assert str(err.value) == ("`memory.loss`: chunked loss needs a causal LM with a decoder and an output "
                              "head; BertForSequenceClassification has no output head. Fix: set "
                              "`memory.loss: standard`.")

    class HeadOnly(torch.nn.Module):  # an output head, and no decoder named by base_model_prefix
        def get_output_embeddings(self) -> torch.nn.Module:
            return torch.nn.Linear(4, 8)

    for module, has in ((HeadOnly(), "no separate decoder"), (torch.nn.Linear(4, 8), "no output head")):
        with pytest.raises(MemtrainError) as err:
            chunked_loss.apply(module)
        assert str(err.value) == (f"`memory.loss`: chunked loss needs a causal LM with a decoder and an "
                                  f"output head; {type(module).__name__} has {has}. Fix: set "
                                  "`memory.loss: standard`.")


@pytest.mark.parametrize("chunk", [None, 7])
def test_the_record_names_the_model_and_the_chunk(chunk: int | None) -> None:
    """Mutants that survived: the record's module list and summary."""
    (record,) = records(chunked_loss.apply(tiny_model("llama"), chunk))
    assert record.modules == ["LlamaForCausalLM"]
    assert record.detail == f"chunked loss ({chunk or 'auto'} tokens per chunk)"


def test_chunks_follow_the_rule_for_tokens_hidden_and_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutants that survived: the chunk rule fed the hidden size for the token count, the token
    count for the hidden size, or the head's input size for the vocabulary; the loss is the same
    whatever the chunks, so only the number of head calls shows it."""
    monkeypatch.setattr(chunked_loss, "MIN_CHUNK_BYTES", 0)  # Liger's rule alone
    head = torch.nn.Linear(8, 64)
    calls: list[int] = []
    head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    hidden = torch.randn(4, 25, 8)
    labels = torch.randint(0, 64, (4, 25))
    with torch.no_grad():
        chunked_loss.chunked_cross_entropy(hidden, labels, head)
    # 100 tokens, ceil(64 / 8) = 8 chunks' worth: 13 tokens, 8 chunks of 13 (the last one 9)
    assert calls == [13] * 7 + [9]


@pytest.mark.parametrize(("tokens", "hidden", "vocab", "expected"), [
    (65536, 4096, 128256, 521),  # Liger's 2048 capped at 256 MiB (523 tokens): 126 equal chunks
    (4128, 4096, 128256, 129),  # Liger's rule above the floor: 4128 / 32, no rounding up
    (16384, 4096, 128256, 512),  # Liger's 512 is under the cap
    (131072, 512, 256, 131072),  # a byte-level vocabulary smaller than the hidden size: one chunk
])
def test_chunk_rule_beyond_its_floor(tokens: int, hidden: int, vocab: int, expected: int) -> None:
    """Mutants that survived ``test_chunk_rule``, whose two cases both land on 128 or the floor."""
    assert chunked_loss.chunk_tokens(tokens, hidden, vocab) == expected


def test_the_chunk_grows_smoothly_with_the_length_and_its_logits_stay_under_the_cap() -> None:
    """One token more never makes a chunk much larger (a power-of-two rounding doubled it one
    token past 2^k, and with it the estimate), and no chunk's fp32 logits exceed the cap, however
    long the context (Llama-3.1-8B: hidden 4096, vocabulary 128,256)."""
    vocab = 128256
    lengths = [*range(1, 300, 7), *range(4000, 4200), *range(65400, 65700), *range(262000, 262200), 1_000_000]
    sizes = {t: chunked_loss.chunk_tokens(t, 4096, vocab) for t in lengths}
    for t in lengths:
        if t + 1 in sizes:
            assert sizes[t + 1] <= sizes[t] + 1, (t, sizes[t], sizes[t + 1])
        assert sizes[t] * 4 * vocab <= chunked_loss.MAX_CHUNK_BYTES + 4 * vocab
        assert sizes[t] * 4 * vocab >= chunked_loss.MIN_CHUNK_BYTES or sizes[t] == t, t


# ------------------------------------------------------------------ chunk size from the budget


@pytest.mark.parametrize(("memory", "message"), [
    ({"loss": "chunked", "loss_chunk_tokens": 0}, "at least 1"),
    ({"loss": "standard", "loss_chunk_tokens": 256}, "the loss is `standard`"),
    ({"loss": "standard", "loss_chunk_tokens": "auto"}, "the loss is `standard`"),
])
def test_bad_chunk_sizes_name_the_field(memory: dict, message: str, tmp_path: Path,
                                        tiny_text_file: Path) -> None:
    with pytest.raises(RecipeError, match=rf"memory\.loss_chunk_tokens.*{message}.*Fix"):
        load_recipe(causal_recipe(tmp_path, tiny_text_file, memory=memory))


def test_an_estimate_of_an_auto_chunk_asks_for_the_planner(tmp_path: Path, tiny_text_file: Path) -> None:
    from memtrain.estimator.estimate import estimate

    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"loss": "chunked",
                                                                      "loss_chunk_tokens": "auto"}))
    with pytest.raises(MemtrainError, match=r"memory\.loss_chunk_tokens.*auto.*Fix"):
        estimate(cfg, device="cpu")


def test_the_planner_sizes_the_loss_chunk_from_the_budget(tmp_path: Path, tiny_text_file: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`memory.loss_chunk_tokens: auto` on a model whose loss is its peak (vocabulary 32,768,
    hidden 64, 2 x 1,024 tokens): one chunk of all 2,048 tokens (256 MiB of fp32 logits) keeps
    most, the rule's 256-token chunks less, 64-token chunks (8 MiB) least; each budget gets the
    largest chunk that fits it."""
    from memtrain.estimator.estimate import estimate
    from memtrain.plan import planner, space

    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(tmp_path / "calibration.json"))
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, data={"max_length": 1024},
                                    model={"from_config": {**TINY_CONFIGS["llama"], "vocab_size": 32768,
                                                           "num_hidden_layers": 1,
                                                           "max_position_embeddings": 1024}},
                                    training={"micro_batch_size": 2},
                                    memory={"loss": "chunked", "loss_chunk_tokens": "auto"}))
    assert space.ladder(cfg, CHUNK_TOKENS) == [8192, None, 64]
    totals = {size: estimate(planner.with_values(cfg, {"memory.loss_chunk_tokens": size}),
                             device="cpu").total_bytes for size in (8192, None, 64)}
    assert totals[8192] - totals[None] > 256 * 2**20 and totals[None] - totals[64] > 32 * 2**20
    chosen = {}
    cache = TraceCache()  # the plans below share their traces (none depends on the budget)
    for size in (8192, None, 64):
        plan = planner.plan(cfg, int(totals[size] / 0.9) + 1, device="cpu", cache=cache)
        chosen[size] = plan.chosen.values["memory.loss_chunk_tokens"]
        assert plan.apply(cfg).memory.loss_chunk_tokens == chosen[size]
    assert chosen[None] is None and chosen[64] == 64  # the largest that fits, where the rule does not
    assert chosen[8192] in (8192, None)  # roomy: the faster of the two (within 5%: the smaller peak)
    with pytest.raises(MemtrainError):  # less than the smallest chunk needs: nothing fits
        planner.plan(cfg, int(totals[64] * 0.8), device="cpu", cache=cache)


def test_chunk_sizes_rank_around_the_rule() -> None:
    """The dominance pruning's order: chunks above the rule's cap keep more than the rule, chunks
    below its floor less (a mutant that ranks by tokens alone, without the vocabulary, fails)."""
    from memtrain.plan.space import rank

    vocab = 32768
    big, rule, small = (rank(CHUNK_TOKENS, size, 1, vocab) for size in (8192, None, 64))
    assert big < rule < small
    assert rank(CHUNK_TOKENS, 8192, 1, 512) == rank(CHUNK_TOKENS, 64, 1, vocab) == (2,)  # 16 MiB: below
