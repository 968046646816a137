"""Architecture configs of popular models, so that ``memtrain estimate`` works offline.

The numbers are the memory-relevant entries of each model's public ``config.json`` on the
Hugging Face Hub (layer count and widths, heads, vocabulary, tied embeddings, context length);
everything else keeps the transformers default for the ``model_type``, which changes no tensor
size. Instruct/chat variants share the base model's architecture and are listed as aliases.

A recipe's ``model.name`` matches an entry by hub id or by the part after the slash, ignoring case
(``meta-llama/Llama-3.1-8B``, ``llama-3.1-8b-instruct``).
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA32_ROPE = {**_LLAMA3_ROPE, "factor": 32.0}


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, tie: bool,
           rope: dict[str, Any] | None, max_pos: int = 131072, **extra: Any) -> dict[str, Any]:
    values = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
              "vocab_size": 128256, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": tie, **extra}
    if rope:
        values["rope_scaling"] = rope
    return values


def _qwen2(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tie: bool,
           max_pos: int = 131072) -> dict[str, Any]:
    return {"model_type": "qwen2", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "max_position_embeddings": max_pos, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": tie, "use_sliding_window": False}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tie: bool) -> dict[str, Any]:
    return {"model_type": "qwen3", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": tie}


def _gemma2(hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int) -> dict[str, Any]:
    return {"model_type": "gemma2", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "vocab_size": 256000, "max_position_embeddings": 8192,
            "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}


def _mistral(vocab: int, rope_theta: float, sliding: int | None) -> dict[str, Any]:
    return {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": vocab, "max_position_embeddings": 32768, "rope_theta": rope_theta,
            "sliding_window": sliding, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _gpt2(embd: int, layers: int, heads: int) -> dict[str, Any]:
    return {"model_type": "gpt2", "n_embd": embd, "n_layer": layers, "n_head": heads,
            "vocab_size": 50257, "n_positions": 1024}


def _bert(model_type: str, hidden: int, layers: int, heads: int, vocab: int, **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "intermediate_size": 4 * hidden, "vocab_size": vocab,
            **extra}


_ROBERTA = {"max_position_embeddings": 514, "type_vocab_size": 1, "pad_token_id": 1,
            "layer_norm_eps": 1e-5}

# hub id -> (config values, extra aliases)
CATALOG: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "meta-llama/Llama-3.2-1B": (_llama(2048, 8192, 16, 32, 8, True, _LLAMA32_ROPE, head_dim=64),
                                ("meta-llama/Llama-3.2-1B-Instruct",)),
    "meta-llama/Llama-3.2-3B": (_llama(3072, 8192, 28, 24, 8, True, _LLAMA32_ROPE, head_dim=128),
                                ("meta-llama/Llama-3.2-3B-Instruct",)),
    "meta-llama/Llama-3.1-8B": (_llama(4096, 14336, 32, 32, 8, False, _LLAMA3_ROPE),
                                ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B")),
    "meta-llama/Llama-3.1-70B": (_llama(8192, 28672, 80, 64, 8, False, _LLAMA3_ROPE),
                                 ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.3-70B-Instruct",
                                  "meta-llama/Meta-Llama-3.1-70B")),
    "meta-llama/Meta-Llama-3-8B": (_llama(4096, 14336, 32, 32, 8, False, None, max_pos=8192),
                                   ("meta-llama/Meta-Llama-3-8B-Instruct",)),
    "meta-llama/Meta-Llama-3-70B": (_llama(8192, 28672, 80, 64, 8, False, None, max_pos=8192),
                                    ("meta-llama/Meta-Llama-3-70B-Instruct",)),
    "mistralai/Mistral-7B-v0.1": (_mistral(32000, 10000.0, 4096), ("mistralai/Mistral-7B-Instruct-v0.1",)),
    "mistralai/Mistral-7B-v0.3": (_mistral(32768, 1000000.0, None), ("mistralai/Mistral-7B-Instruct-v0.3",)),
    **{f"Qwen/Qwen2.5-{size}": (values, (f"Qwen/Qwen2.5-{size}-Instruct",)) for size, values in (
        ("0.5B", _qwen2(896, 4864, 24, 14, 2, 151936, True, 32768)),
        ("1.5B", _qwen2(1536, 8960, 28, 12, 2, 151936, True, 32768)),
        ("3B", _qwen2(2048, 11008, 36, 16, 2, 151936, True, 32768)),
        ("7B", _qwen2(3584, 18944, 28, 28, 4, 152064, False)),
        ("14B", _qwen2(5120, 13824, 48, 40, 8, 152064, False)),
        ("32B", _qwen2(5120, 27648, 64, 40, 8, 152064, False)),
        ("72B", _qwen2(8192, 29568, 80, 64, 8, 152064, False)),
    )},
    "Qwen/Qwen3-4B": (_qwen3(2560, 9728, 36, 32, True), ()),
    "Qwen/Qwen3-8B": (_qwen3(4096, 12288, 36, 32, False), ()),
    "Qwen/Qwen3-14B": (_qwen3(5120, 17408, 40, 40, False), ()),
    "Qwen/Qwen3-32B": (_qwen3(5120, 25600, 64, 64, False), ()),
    "google/gemma-2-2b": (_gemma2(2304, 9216, 26, 8, 4, 256), ("google/gemma-2-2b-it",)),
    "google/gemma-2-9b": (_gemma2(3584, 14336, 42, 16, 8, 256), ("google/gemma-2-9b-it",)),
    "google/gemma-2-27b": (_gemma2(4608, 36864, 46, 32, 16, 128), ("google/gemma-2-27b-it",)),
    "microsoft/Phi-3-mini-4k-instruct": (
        {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
         "max_position_embeddings": 4096, "tie_word_embeddings": False, "pad_token_id": 32000},
        ("phi-3-mini",)),
    "openai-community/gpt2": (_gpt2(768, 12, 12), ("gpt2",)),
    "openai-community/gpt2-medium": (_gpt2(1024, 24, 16), ("gpt2-medium",)),
    "openai-community/gpt2-large": (_gpt2(1280, 36, 20), ("gpt2-large",)),
    "openai-community/gpt2-xl": (_gpt2(1600, 48, 25), ("gpt2-xl",)),
    "google-bert/bert-base-uncased": (_bert("bert", 768, 12, 12, 30522), ("bert-base-uncased",)),
    "google-bert/bert-base-cased": (_bert("bert", 768, 12, 12, 28996), ("bert-base-cased",)),
    "google-bert/bert-large-uncased": (_bert("bert", 1024, 24, 16, 30522), ("bert-large-uncased",)),
    "FacebookAI/roberta-base": (_bert("roberta", 768, 12, 12, 50265, **_ROBERTA), ("roberta-base",)),
    "FacebookAI/roberta-large": (_bert("roberta", 1024, 24, 16, 50265, **_ROBERTA), ("roberta-large",)),
}


def _index() -> dict[str, str]:
    """Lower-cased hub ids, their short names and aliases -> canonical hub id."""
    index: dict[str, str] = {}
    for hub_id, (_, aliases) in CATALOG.items():
        for name in (hub_id, *aliases):
            index[name.lower()] = hub_id
            index[name.rsplit("/", 1)[-1].lower()] = hub_id
    return index


def lookup(name: str) -> tuple[str, dict[str, Any]] | None:
    """(canonical hub id, config values) for a catalog model, or None."""
    hub_id = _index().get(name.strip().lower())
    if hub_id is None:
        return None
    return hub_id, dict(CATALOG[hub_id][0])


def names() -> list[str]:
    """The canonical hub ids in the catalog."""
    return list(CATALOG)
