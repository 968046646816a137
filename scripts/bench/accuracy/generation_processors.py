"""The sampling step of HF ``generate`` with each logits processor a GRPO user sets (temperature,
top_k, top_p, min_p, repetition_penalty, and combinations; and what TRL's ``generation_kwargs``
add: a minimum length, typical-p, epsilon and eta cutoffs, n-gram blocking, top-h), measured
against memtrain's generation phase (memtrain.estimator.grpo.generation_memory):
python -m scripts run generation_processors

Measured: scripts/probes/memprobe.py's LiveBytes (no memtrain code) around ``model.generate`` of a tiny
Llama built from a config (fp32, vocabulary 30,522), TRL's generation settings (do_sample, an
end-of-sequence id, no compile), every prompt 4 tokens and 16 new tokens, so the sampling step's
rows x vocabulary tensors are the peak. Predicted: the generation phase with resident=0 (the weights
exist before the probe starts). Writes docs/bench/generation_processors.md.
"""

from __future__ import annotations

import argparse
import sys

import torch

from scripts import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "tests"))  # tests/plain_trainer.py: the tiny model the tests train

CASES = {"none": {}, "temperature 0.7": {"temperature": 0.7}, "top_k 50": {"top_k": 50},
         "top_p 0.9": {"top_p": 0.9}, "min_p 0.1": {"min_p": 0.1},
         "repetition_penalty 1.1": {"repetition_penalty": 1.1},
         "top_k 50 + top_p 0.9": {"top_k": 50, "top_p": 0.9},
         "temperature 0.7 + top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
         "repetition_penalty 1.1 + temperature 0.7": {"repetition_penalty": 1.1, "temperature": 0.7},
         "top_p 0.9 + min_p 0.1": {"top_p": 0.9, "min_p": 0.1},
         "top_k 50 + min_p 0.1": {"top_k": 50, "min_p": 0.1},
         "all five": {"repetition_penalty": 1.1, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.1},
         # what only TRL's `generation_kwargs` set (a user's GRPOConfig)
         "min_new_tokens 8": {"min_new_tokens": 8}, "min_length 12": {"min_length": 12},
         "typical_p 0.9": {"typical_p": 0.9}, "epsilon_cutoff 3e-4": {"epsilon_cutoff": 3e-4},
         "eta_cutoff 3e-4": {"eta_cutoff": 3e-4}, "no_repeat_ngram_size 3": {"no_repeat_ngram_size": 3},
         "top_h 0.4": {"top_h": 0.4},
         "temperature 0.7 + typical_p 0.9": {"temperature": 0.7, "typical_p": 0.9},
         "repetition_penalty 1.1 + min_new_tokens 8": {"repetition_penalty": 1.1, "min_new_tokens": 8},
         "min_new_tokens 8 + top_p 0.9": {"min_new_tokens": 8, "top_p": 0.9}}
SHAPES = [(32, 4, 16), (64, 4, 16)]  # rows, prompt tokens, new tokens
QUICK = ["--case", "none", "--case", "top_p 0.9"]  # 4 calls of `generate` (of 24), issue 38's case in them


def measure(model: torch.nn.Module, rows: int, prompt: int, new: int, extra: dict) -> int:
    from transformers import GenerationConfig

    from scripts.probes.memprobe import LiveBytes

    settings = dict(max_new_tokens=new, do_sample=True, pad_token_id=0, bos_token_id=None, eos_token_id=[102],
                    temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    settings.update(extra)
    config = GenerationConfig(**settings, disable_compile=True)
    torch.manual_seed(0)
    ids = torch.randint(1000, 2000, (rows, prompt))
    mask = torch.ones_like(ids)
    probe = LiveBytes()
    probe.adopt([ids, mask])
    with torch.no_grad(), probe:
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return probe.device_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(CASES), metavar="PROCESSORS",
                        help="only these processor cases (repeatable; default: all): " + ", ".join(CASES))
    args = parser.parse_args()
    cases = {name: CASES[name] for name in args.case} if args.case else CASES
    from plain_trainer import tiny_model

    from memtrain.estimator.grpo import generation_memory, sampling_processors

    model = tiny_model().eval()
    title = "The sampling step's logits processors: HF generate measured vs memtrain's generation phase"
    lines = [*harness.header(title),
             "Tiny Llama from a config, fp32, vocabulary "
             "30,522; prompts of 4 tokens, 16 new tokens; TRL's generation settings. Measured: "
             "scripts/probes/memprobe.py's LiveBytes around `generate`. Predicted: "
             "`memtrain.estimator.grpo.generation_memory` (resident 0).", "",
             "| rows | processors | measured bytes | predicted bytes | predicted / measured |",
             "|---:|---|---:|---:|---:|"]
    worst = []
    for rows, prompt, new in SHAPES:
        for name, extra in cases.items():
            measured = measure(model, rows, prompt, new, extra)
            processors = sampling_processors(**extra)
            predicted = generation_memory(model.config, resident=0, sequences=rows, prompt=prompt,
                                          completion=new, size=4, processors=processors).peak_bytes
            worst.append(predicted / measured)
            lines.append(f"| {rows} | {name} | {measured:,} | {predicted:,} | {predicted / measured:.3f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Predicted / measured from {min(worst):.3f} to {max(worst):.3f} over {len(worst)} rows.",
              "Before (only a temperature counted, as one more tensor): top_p 0.9 was predicted at 0.459 of "
              "its measured peak (issue 38). Before the `generation_kwargs` processors were counted, "
              "typical_p 0.9 after a temperature was predicted at 0.35 of its measured peak."]
    harness.write("generation_processors", lines)


if __name__ == "__main__":
    main()
