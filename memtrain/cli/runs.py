"""``memtrain report``, ``merge``, ``generate`` and ``predict``: commands on a finished run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from memtrain import lazy_setup
from memtrain.cli.common import RunDir, console, err_console
from memtrain.errors import MemtrainError


def report(run_dir: Annotated[str, typer.Argument(help="The output folder of a finished run.")]) -> None:
    """Re-render a run's memory report (PNG) and print its summary table."""
    from pathlib import Path

    from memtrain.memory.report import REPORT_PNG, comparison, load_report, render_png, summary_rows

    folder = Path(run_dir)
    loaded = load_report(folder)
    try:
        render_png(loaded, folder / REPORT_PNG)
    except OSError as err:
        raise MemtrainError(f"`report`: cannot write {folder / REPORT_PNG} ({err.strerror or err}). Fix: "
                            "make the folder writable, or copy the run folder somewhere you can write "
                            "and run `memtrain report` on the copy.") from None
    table = Table("category", "measured at peak", "predicted", "error",
                  title=f"memory of one training step — {loaded.measured['device']}")
    for row in summary_rows(loaded):
        table.add_row(*row)
    console.print(table)
    console.print(f"compared: {comparison(loaded)}", highlight=False, soft_wrap=True)
    console.print(f"plot: {folder / REPORT_PNG}")


def merge(run_dir: RunDir, out: Annotated[Path | None, typer.Option(
        help="Folder for the merged model (default: RUN_DIR/merged).")] = None) -> None:
    """Fold a run's LoRA adapter into the base weights (a 4-bit base is dequantized first) and save
    an ordinary Hugging Face model folder."""
    with lazy_setup.importing():
        from memtrain.run.inference import merge as merge_run

    folder = merge_run(run_dir, out)
    console.print(f"merged model saved to {folder}", highlight=False)


def generate(
    run_dir: RunDir,
    prompt: Annotated[str | None, typer.Argument(
        help="What to continue; chat runs wrap it in the chat template. Omit it to chat: one "
        "message per line on standard input, the conversation kept, until end of input.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    input_text: Annotated[str, typer.Option(
        "--input", help="alpaca runs: the input that goes with the instruction PROMPT.")] = "",
) -> None:
    """Generate text with a trained causal LM, written the way its training data was."""
    with lazy_setup.importing():
        from memtrain.run.inference import continuation, load_run

    def run_generate(text: str | list[dict[str, str]], extra: str = "") -> str:
        made = continuation(run, text, max_new_tokens, temperature, extra)
        if made.empty_because:  # still status 0: generating worked, the model said nothing
            err_console.print(f"note: {made.empty_because}", highlight=False, markup=False)
        return made.text

    run = load_run(run_dir)
    if input_text and prompt is None:
        raise MemtrainError("`--input` goes with an instruction PROMPT, and none was given (the "
                            "instructions are read from standard input). Fix: give PROMPT, or drop "
                            "`--input`.")
    if prompt is not None:
        console.print(run_generate(prompt, input_text), highlight=False, markup=False)
        return
    chat = run.cfg.data.kind in ("messages", "sharegpt")
    history: list[dict[str, str]] = []
    for line in sys.stdin:
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        answer = run_generate(history if chat else line.strip())
        history.append({"role": "assistant", "content": answer})
        console.print(f"> {answer}", highlight=False, markup=False)


def predict(
    run_dir: RunDir,
    file: Annotated[Path, typer.Argument(help="Texts to classify (.jsonl, .json, .csv, .parquet, "
                                         ".txt), in the run's `data.text_column`.")],
    out: Annotated[Path | None, typer.Option(
        help="Where to write predictions: .csv or .jsonl (default: print JSON lines).")] = None,
) -> None:
    """Label texts with a trained classifier: the label, its probability and every class's."""
    with lazy_setup.importing():
        from memtrain.run.inference import load_run, read_texts, write_rows
        from memtrain.run.inference import predict as run_predict

    run = load_run(run_dir)
    rows = run_predict(run, read_texts(run, file))
    if out is None:
        for row in rows:
            console.print(json.dumps(row), highlight=False, markup=False, soft_wrap=True)
    else:
        write_rows(rows, out)
        err_console.print(f"{len(rows)} predictions written to {out}")
