"""Padding waste with and without packing, for the offline causal-LM recipes.

    python -m scripts run packing

For each recipe, the training split is prepared twice (``data.packing`` true and false) and cut
into micro-batches of the recipe's size in a seeded random order, as the Trainer samples them;
each micro-batch is padded to its longest row, as the collators do. Reported: rows, micro-batches
per epoch, and the share of the padded tensors that holds real tokens. Data only, no model.
Writes docs/bench/packing.md.
"""

from __future__ import annotations

import random

import datasets

from memtrain.config import load_recipe
from memtrain.data.prepare import prepare_data
from memtrain.model import load_tokenizer
from scripts import harness

ROOT = harness.ROOT
QUICK: list[str] = []  # data only: the whole run is CI-sized
RECIPES = ["tiny-llama-shakespeare", "tiny-llama-which-play"]


def batches(lengths: list[int], micro: int, seed: int) -> tuple[int, int]:
    """(real tokens, padded tokens) over an epoch of micro-batches padded to their longest row."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    real = padded = 0
    for i in range(0, len(order), micro):
        chunk = [lengths[j] for j in order[i: i + micro]]
        real += sum(chunk)
        padded += max(chunk) * len(chunk)
    return real, padded


def main() -> None:
    datasets.disable_progress_bars()
    rows = ["| recipe | packing | rows | micro-batches / epoch | real tokens | padded tensor "
            "tokens | real share |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in RECIPES:
        for packing in (False, True):
            cfg = load_recipe(ROOT / "recipes" / f"{name}.yaml", [f"data.packing={packing}"])
            data = prepare_data(cfg, load_tokenizer(cfg.model))
            lengths = [len(x) for x in data.train["input_ids"]]
            micro = int(cfg.training.micro_batch_size)
            real, padded = batches(lengths, micro, cfg.training.seed)
            rows.append(f"| {name} | {packing} | {len(lengths):,} | {-(-len(lengths) // micro):,} | "
                        f"{real:,} | {padded:,} | {real / padded:.1%} |")
            print(rows[-1], flush=True)
    lines = [
        *harness.header("Packing: padding waste", libraries=(*harness.LIBRARIES, "datasets")),
        "Data only, no model.", "",
        "Training split of each offline causal recipe, micro-batches of the recipe's size in a "
        "seeded random order, each padded to its longest row. Packing keeps examples apart "
        "(positions restart, no attention across examples; see memtrain/data/packing.py).", "",
        *rows, ""]
    harness.write("packing", lines)


if __name__ == "__main__":
    main()
