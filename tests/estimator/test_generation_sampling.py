"""The generation phase's sampling step with the logits processors GRPO users set (issue 38):
memtrain.estimator.grpo's per-processor counts against scripts/probes/memprobe.py (no memtrain code) around
HF ``generate``, on a model and shape unlike the ones the counts were measured on (a 3-layer Qwen2 with
an 8,000-token vocabulary, 24 rows, 12-token prompts, 20 new tokens; the counts came from a 2-layer
Llama with 30,522 tokens at 32 and 64 rows, docs/bench/generation_processors.md).

Before: only a temperature was counted, so top_p 0.9 was predicted at 0.46 of its measured peak.
Planted when written: the "+1 when not first" term dropped -> top_k+min_p and all five fail; top_p's
5.5 taken as 4.5 -> top_p fails; HF's order reversed -> all five fail.

The settings only ``generation_kwargs`` carry (a minimum length, typical-p, the epsilon and eta
cutoffs, n-gram blocking) were not counted before: typical-p after a temperature was predicted at
0.35 of its measured peak, a minimum of new tokens at 0.58 (the tiny Llama of
docs/bench/generation_processors.md, 32 rows).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from memtrain.estimator.grpo import generation_memory, sampling_processors
from scripts.probes.memprobe import LiveBytes

ROWS, PROMPT, NEW = 24, 12, 20


@pytest.fixture(scope="module")
def model() -> Any:
    config = AutoConfig.for_model("qwen2", hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=8000,
                                  max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("extra", [
    {}, {"top_p": 0.9}, {"top_k": 40, "min_p": 0.05}, {"temperature": 0.6, "repetition_penalty": 1.2},
    {"repetition_penalty": 1.1, "temperature": 0.7, "top_k": 50, "top_p": 0.95, "min_p": 0.1},
    # what only TRL's `generation_kwargs` set (a user's GRPOConfig)
    {"min_new_tokens": 8}, {"temperature": 0.7, "typical_p": 0.9}, {"eta_cutoff": 3e-4},
    {"no_repeat_ngram_size": 3, "epsilon_cutoff": 3e-4}, {"repetition_penalty": 1.1, "min_length": 20},
], ids=["none", "top_p", "top_k+min_p", "temperature+repetition", "all five", "min_new_tokens",
        "temperature+typical_p", "eta", "ngram+epsilon", "repetition+min_length"])
def test_the_sampling_step_is_predicted_for_each_processor(model: Any, extra: dict[str, Any]) -> None:
    settings = dict(max_new_tokens=NEW, do_sample=True, pad_token_id=0, bos_token_id=None, eos_token_id=[1],
                    temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    settings.update(extra)
    ids = torch.randint(10, 7000, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    probe = LiveBytes()
    probe.adopt([ids, mask])
    with torch.no_grad(), probe:
        out = model.generate(input_ids=ids, attention_mask=mask,
                             generation_config=GenerationConfig(**settings, disable_compile=True))
    completion = out.shape[1] - PROMPT
    processors = sampling_processors(**extra)
    phase = generation_memory(model.config, resident=0, sequences=ROWS, prompt=PROMPT, completion=completion,
                              size=4, processors=processors)
    predicted = phase.peak_bytes
    assert probe.device_peak <= predicted <= 1.05 * probe.device_peak, (predicted, probe.device_peak)
    assert ("(with " in phase.describe()) == bool(extra) and all(p in phase.describe() for p in processors)


@pytest.mark.parametrize("model_type,window", [
    ("gemma2", 8),  # sliding and global layers alternate (layer_types); the window shorter than the prompt
    ("mistral", 16),  # every layer sliding (no layer_types: its sliding_window); prompt < window < length
])
def test_sliding_window_layers_cache_their_window(model_type: str, window: int) -> None:
    """A sliding-window layer's cache keeps the window, not the whole completion (transformers'
    DynamicSlidingWindowLayer). Counted as full attention they were 1.14x (Gemma-2) and 1.22x
    (Mistral) the measured peak of this generation, where the full-attention Qwen2 above is 1.03x.
    (Where the prefill dominates, a tiny vocabulary and MLP, the model of the prefill is low: not here.)"""
    config = AutoConfig.for_model(model_type, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=12, vocab_size=8000,
                                  max_position_embeddings=128, sliding_window=window)
    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(10, 7000, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    probe = LiveBytes()
    probe.adopt([ids, mask])
    settings = GenerationConfig(max_new_tokens=40, do_sample=True, pad_token_id=0, bos_token_id=None,
                                eos_token_id=[1], temperature=1.0, top_p=1.0, top_k=0, disable_compile=True)
    with torch.no_grad(), probe:
        out = small.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
    completion = out.shape[1] - PROMPT
    assert PROMPT + completion > window  # the window is what bounds these layers' caches
    predicted = generation_memory(small.config, resident=0, sequences=ROWS, prompt=PROMPT,
                                  completion=completion, size=4).peak_bytes
    assert probe.device_peak <= predicted <= 1.05 * probe.device_peak, (predicted, probe.device_peak)


def test_a_grpo_config_s_generation_kwargs_are_counted_or_named(model: Any) -> None:
    """TRL passes ``generation_kwargs`` over its own sampling settings: the processors they add are
    counted, and those memtrain has not measured are named in the phase's description (the plan's
    notes), never silently left out. Planted: the kwargs ignored -> typical_p is not counted and
    the bad words are not named."""
    from types import SimpleNamespace

    from memtrain.estimator.grpo import trainer_generation_phase

    def phase(**kwargs: Any) -> Any:
        args = SimpleNamespace(bf16=False, fp16=False, generation_batch_size=ROWS, world_size=1,
                               max_completion_length=NEW, temperature=0.7, top_p=1.0, top_k=0, min_p=None,
                               repetition_penalty=1.0, generation_kwargs=kwargs)
        return trainer_generation_phase(SimpleNamespace(args=args, model=model), 0, PROMPT)

    plain, typical = phase(), phase(typical_p=0.9, bad_words_ids=[[5]], forced_bos_token_id=0)
    assert plain.processors == ("temperature",) and plain.uncounted == ()
    assert typical.processors == ("temperature", "typical_p")
    assert typical.sampling > plain.sampling * 2
    assert typical.uncounted == ("bad_words_ids", "forced_bos_token_id")
    assert "not counted: the logits processors of bad_words_ids, forced_bos_token_id" in typical.describe()
    assert phase(top_p=0.9, temperature=1.0).processors == ("top_p",)  # the kwargs over the config's own
    assert phase(guidance_scale=1, renormalize_logits=False).uncounted == ()  # HF's "off" values
    # a value that is not a number (HF refuses it when it generates): named, not a TypeError here
    odd = phase(typical_p="0.9")
    assert odd.processors == ("temperature",) and odd.uncounted == ("typical_p",)


@pytest.mark.parametrize("model_type,attn", [("llama", "sdpa"), ("gpt2", "sdpa"), ("qwen3", "sdpa"),
                                             ("llama", "eager")])
def test_a_prefill_that_dominates_is_never_predicted_low(model_type: str, attn: str) -> None:
    """Long left-padded prompts, few new tokens, a small vocabulary: the prompts' prefill is the
    generation's peak. Counted per token as two MLP intermediates and four hidden-size tensors it was
    0.85 of the measured peak for the Llama, 0.68 for GPT-2, 0.56 for Qwen3 (head_dim 128) and 0.36
    with eager attention (its rows x heads x prompt^2 scores); the prefill traced on fake tensors
    (`prefill_per_row`) counts what each family keeps. It counts the layer's keys and values beside
    the KV cache, which holds them too: up to ~1.2x where heads are wide (Qwen3, Gemma)."""
    rows, prompt, new = 16, 120, 4
    if model_type == "gpt2":
        values = dict(n_embd=48, n_inner=192, n_layer=3, n_head=4, vocab_size=512, n_positions=256)
    else:
        values = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    ids = torch.randint(10, 500, (rows, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # a shorter prompt, left-padded as TRL pads a generation batch
    probe = LiveBytes()
    probe.adopt([ids, mask])
    settings = dict(max_new_tokens=new, do_sample=True, pad_token_id=0, bos_token_id=None, eos_token_id=[1],
                    temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    with torch.no_grad(), probe:
        out = model.generate(input_ids=ids, attention_mask=mask,
                             generation_config=GenerationConfig(**settings, disable_compile=True))
    phase = generation_memory(model.config, resident=0, sequences=rows, prompt=prompt,
                              completion=out.shape[1] - prompt, size=4)
    assert phase.prefill > phase.sampling  # the case this test is about
    measured = probe.device_peak
    assert measured <= phase.peak_bytes <= 1.25 * measured, (phase.peak_bytes, measured)


def test_the_prefill_cache_keeps_the_most_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived process (a notebook, a service) plans many configs and lengths: the prefill
    traces it keeps are the :data:`grpo.PREFILL_KEPT` most recently used, a hit traced once."""
    from transformers import LlamaConfig

    from memtrain.estimator import grpo

    traced: list[int] = []
    monkeypatch.setattr(grpo, "_PREFILL", {})
    monkeypatch.setattr(grpo, "PREFILL_KEPT", 3)
    monkeypatch.setattr(grpo, "_traced_prefill",
                        lambda text, attn, prompt, size: traced.append(prompt) or prompt)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    for prompt in (1, 2, 3, 1, 4, 1, 2):
        assert grpo.prefill_per_row(text, prompt, 2) == prompt
    assert traced == [1, 2, 3, 4, 2]  # 1 kept by its uses; 2, the least recently used, dropped for 4
    assert [key[2] for key in grpo._PREFILL] == [4, 1, 2]
