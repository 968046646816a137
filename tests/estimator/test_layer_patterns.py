"""Models whose layers are of several kinds: the short traces hold each kind where the model has it.

Qwen3.5 interleaves linear-attention (Gated DeltaNet) and full-attention layers, DeepSeek-V3 starts
with dense layers before its mixture-of-experts ones, Gemma-2 alternates sliding-window and global
attention. Traced at depths 2 and 3 these were counted as if every layer were the first kind
(Qwen3.5's parameters, LoRA weights and activations off, a Gemma-3's full-attention tensors missed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MINILM, causal_recipe

from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate
from memtrain.estimator.layers import Pattern, find_pattern, layer_pattern
from memtrain.estimator.setup import resolve_config

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 30522, "max_position_embeddings": 256}
HYBRID = {
    # linear attention, full attention, ... (Qwen3.5's default is one full layer in four)
    "qwen3_5": ({"model_type": "qwen3_5_text", **SMALL, "full_attention_interval": 2,
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16}, 12, (4, 6)),
    # two dense layers, then experts
    "deepseek_v3": ({"model_type": "deepseek_v3", **SMALL, "num_key_value_heads": 4,
                     "first_k_dense_replace": 2, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                     "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                     "v_head_dim": 16}, 10, (4, 5)),
    # sliding-window and global attention, alternating
    "gemma2": ({"model_type": "gemma2", **SMALL, "sliding_window": 16}, 12, (4, 6)),
}


def _recipe(tmp_path: Path, data_file: Path, arch: str) -> dict:
    config, depth, _ = HYBRID[arch]
    out = causal_recipe(tmp_path, data_file)
    out["model"] = {"from_config": {**config, "num_hidden_layers": depth}, "tokenizer": MINILM}
    if arch == "deepseek_v3":  # grouped expert matmuls: bf16 (memtrain.estimator.fake)
        out["model"]["dtype"] = "bf16"
    return out


@pytest.mark.parametrize("arch", sorted(HYBRID))
def test_a_model_of_several_layer_kinds_extrapolates_to_its_whole_trace(arch: str, tmp_path: Path,
                                                                         tiny_text_file: Path) -> None:
    cfg = load_recipe(_recipe(tmp_path, tiny_text_file, arch))
    _, depth, (short, longer) = HYBRID[arch]
    fast = estimate(cfg, device="cuda")
    full = estimate(cfg, device="cuda", exact=True)
    assert fast.method.startswith(f"traced {short} and {longer} of {depth} layers (")
    assert full.method == f"traced all {depth} layers"
    assert (fast.parameters, fast.trainable) == (full.parameters, full.trainable)
    assert fast.peak_bytes == full.peak_bytes
    assert fast.by_category == full.by_category
    assert fast.by_phase == full.by_phase
    assert fast.total_bytes == full.total_bytes


def test_alike_layers_are_traced_at_two_and_three(tmp_path: Path, tiny_text_file: Path) -> None:
    for arch in ("llama", "gpt2"):  # GPT-2's `scale_attn_by_inverse_layer_idx` is a flag, not an index
        out = causal_recipe(tmp_path, tiny_text_file, arch)
        out["model"]["from_config"]["n_layer" if arch == "gpt2" else "num_hidden_layers"] = 12
        cfg = load_recipe(out)
        config = resolve_config(cfg.model)[0]
        assert layer_pattern(cfg, config, 12) == Pattern(12), arch
        assert estimate(cfg, device="cpu").method.startswith("traced 2 and 3 of 12 layers, extrapolated")


@pytest.mark.parametrize("kinds,expected,traced", [
    ("a" * 32, Pattern(32), (2, 3)),
    ("lllf" * 8, Pattern(32, 4, 4, 2), (8, 12)),  # Qwen3.5: the first full layer is one of its own
    ("ddd" + "m" * 58, Pattern(61, 4, 1, 2), (5, 6)),  # DeepSeek-V3: three dense layers
    ("d" + "m" * 47, Pattern(48, 2, 1, 2), (3, 4)),  # one dense layer (GLM-4.5), and the first expert one
    ("sssssf" * 10 + "ss", Pattern(62, 6, 6, 2), (14, 20)),  # Gemma-3 27B: a group cut short at the end
])
def test_the_cheapest_pattern_is_found(kinds: str, expected: Pattern, traced: tuple[int, int]) -> None:
    found = find_pattern(list(kinds))
    assert found == expected
    assert found.traced == traced and found.worth_extrapolating()


@pytest.mark.parametrize("kinds", ["sssssf" * 4 + "ss", "abcdefgh", "a" * 5, "a" * 31 + "b"])
def test_layers_that_do_not_repeat_enough_are_traced_whole(kinds: str) -> None:
    assert not find_pattern(list(kinds)).worth_extrapolating()


def test_a_depth_cut_keeps_layer_kinds_that_are_a_property_of_the_depth() -> None:
    """Falcon-H1's ``layer_types`` is a read-only property of its depth (an alias of
    ``layers_block_type``): setting it was an internal error in validate, estimate and train."""
    from transformers import AutoConfig

    from memtrain.estimator.trace import with_depth

    config = AutoConfig.for_model("falcon_h1", num_hidden_layers=12)
    cut = with_depth(config, 3)
    assert cut.num_hidden_layers == 3 and len(cut.layer_types) == 3
    assert len(with_depth(AutoConfig.for_model("gemma2", num_hidden_layers=12), 3).layer_types) == 3
