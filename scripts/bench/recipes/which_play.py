"""Score a run of recipes/tiny-llama-which-play.yaml on its held-out lines.

    python -m scripts run which_play runs/tiny-llama-which-play [--write]

Rebuilds the run's evaluation split (same seed, so the same lines training never saw), asks the
trained model "Which play is this line from?" for each with greedy decoding, and compares the
answer with the play's title. Prints a markdown table; ``--write`` also saves it to
docs/bench/which_play.md with the command, versions and machine.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from memtrain.data.prepare import load_splits
from memtrain.run.inference import generate, load_run
from scripts import harness

QUICK = None
QUICK_WHY = "it scores a trained run (give its folder); training the recipe takes minutes"


def _norm(tok, text: str) -> str:
    """Text as the tokenizer round-trips it (MiniLM lowercases and splits punctuation)."""
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"]).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    run = load_run(args.run_dir)
    _, held_out = load_splits(run.cfg.data, run.cfg.training.seed)
    assert held_out is not None, "the recipe has no evaluation split"
    start = time.perf_counter()
    hits = collections.Counter()
    totals = collections.Counter()
    titles = {_norm(run.tokenizer, t) for t in set(held_out["output"])}
    valid = 0
    for row in held_out:
        answer = generate(run, row["instruction"], max_new_tokens=12, extra=row["input"])
        title = row["output"]
        totals[title] += 1
        hits[title] += answer == _norm(run.tokenizer, title)
        valid += answer in titles
    seconds = time.perf_counter() - start
    n = sum(totals.values())
    lines = [
        *harness.header("Which play? (recipes/tiny-llama-which-play.yaml)"),
        f"After `memtrain train recipes/tiny-llama-which-play.yaml`; {torch.get_num_threads()} torch "
        f"threads; {n} held-out lines, greedy answers, {seconds:.0f} s.",
        "",
        "| play | held-out lines | answered exactly |",
        "| --- | --- | --- |",
        *[f"| {t} | {totals[t]} | {hits[t] / totals[t]:.3f} |" for t in sorted(totals)],
        f"| **all** | {n} | **{sum(hits.values()) / n:.3f}** |",
        "",
        f"Answers that are one of the {len(titles)} titles: {valid / n:.3f}. Majority-class "
        f"baseline: {max(totals.values()) / n:.3f}; chance: {1 / len(totals):.3f}.",
    ]
    print("\n".join(lines))
    if args.write:
        harness.write("which_play", lines)


if __name__ == "__main__":
    main()
