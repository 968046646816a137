"""What the MLP tile and the loss chunk change in the long-context plan (issue 27), by the estimate.

    python -m scripts run tile_size          # writes docs/bench/tile_size.md
    python -m scripts run tile_size --quick  # both tables at 4,096 tokens only

For Llama-3.1-8B QLoRA r32, batch 1, with the long-context settings of
scripts/bench/planner/long_context.py, ``memtrain.estimate(..., device="cuda")`` (fake-tensor traces of the
real step, plus the CUDA lines) at a few lengths:

1. the tiled MLP's tile size (``memory.tiled_mlp_tile_tokens``: hidden_size = 4,096, 1,024, 256);
2. the chunked loss's chunk (``memory.loss_chunk_tokens``: the default rule, 128 and 64 tokens).

Planned, not trained: the estimate equals an independent count of the real step on CPU for both
patches (tests/patches/test_tiled_mlp.py, tests/patches/test_chunked_loss.py); no GPU has run
these lengths. The inputs (lengths, sizes) are fixed here.
"""

from __future__ import annotations

import argparse
import time

from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate
from scripts import harness
from scripts.bench.planner.long_context import RECIPE, settings

QUICK = ["--lengths", "4096"]  # CI-sized: both tables at 4,096 tokens only
GiB = 2**30
TILES = {"4,096 (hidden_size)": None, "1,024": 1024, "256": 256}
TILE_LENGTHS = (4096, 16384, 65536)
CHUNKS = {"default rule": None, "128": 128, "64": 64}
CHUNK_LENGTHS = (4096, 16384, 65536)


def total(length: int, **fields: int | None) -> tuple[float, str]:
    """Predicted device total (GiB) and the phase of the peak, for the settings plus ``fields``."""
    extra = [f"memory.{k}={'null' if v is None else v}" for k, v in fields.items()]
    base = [s for s in settings() if not s.startswith("memory.tiled_mlp_tile_tokens")]
    e = estimate(load_recipe(RECIPE, [*base, f"data.max_length={length}", *extra]), device="cuda")
    return e.total_bytes / GiB, max(e.by_phase, key=e.by_phase.get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="the lengths of both tables (default: "
                        f"{', '.join(map(str, TILE_LENGTHS))} and {', '.join(map(str, CHUNK_LENGTHS))}; "
                        "given: the page to a temporary folder)")
    args = parser.parse_args()
    tile_lengths = args.lengths or TILE_LENGTHS
    chunk_lengths = args.lengths or CHUNK_LENGTHS
    start = time.perf_counter()
    lines = [*harness.header("Tile and chunk sizes in the long-context plan (issue 27)"),
             "Predicted device totals (GiB) of "
             f"`{RECIPE}` with the settings of docs/bench/long_context.md, by `memtrain.estimate(..., "
             "device=\"cuda\")`; planned, not trained.", "",
             "## Tokens per tiled-MLP tile (`memory.tiled_mlp_tile_tokens`)", "",
             "| tokens | " + " | ".join(TILES) + " |", "|---:|" + "---:|" * len(TILES)]
    for length in tile_lengths:
        cells = [f"{total(length, tiled_mlp_tile_tokens=size)[0]:.3f}" for size in TILES.values()]
        lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", "## Tokens per loss chunk (`memory.loss_chunk_tokens`), MLP tiles of hidden_size", "",
              "| tokens | " + " | ".join(CHUNKS) + " | phase of the peak |",
              "|---:|" + "---:|" * len(CHUNKS) + "---|"]
    for length in chunk_lengths:
        got = [total(length, loss_chunk_tokens=size) for size in CHUNKS.values()]
        lines.append(f"| {length:,} | " + " | ".join(f"{t:.3f}" for t, _ in got) + f" | {got[0][1]} |")
        print(lines[-1], flush=True)
    lines += ["", f"{time.perf_counter() - start:.0f} s."]
    print("\n".join(lines))
    harness.write("tile_size", lines, trial=args.lengths is not None)


if __name__ == "__main__":
    main()
