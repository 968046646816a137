"""The ``memtrain`` command: each subcommand parses arguments and calls one library function.

User mistakes (:class:`MemtrainError`) print their message and exit with status 2, without a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from memtrain.errors import MemtrainError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Fine-tune Hugging Face models under a memory budget.",
)
console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

Recipe = Annotated[str, typer.Argument(help="Recipe YAML file, or the name of a shipped recipe.")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Overrides like `training.learning_rate=1e-4 data.max_examples=500`."),
]


def user_errors(func: F) -> F:
    """Turn MemtrainError into a clean message and exit status 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MemtrainError as err:
            err_console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
            raise typer.Exit(err.exit_code) from None

    return wrapper  # type: ignore[return-value]


def _check_device(device: str | None) -> None:
    """``--device`` must be a device memtrain plans for."""
    if device is None or device in ("cpu", "cuda") or (
            device.startswith("cuda:") and device.removeprefix("cuda:").isdigit()):
        return
    raise MemtrainError(f"`--device` must be cpu, cuda or cuda:N, got {device!r}. Fix: use one of those "
                        "(memtrain does not plan for other devices).")


def _check_budget(budget: str | None) -> None:
    """``--budget`` must be a size or ``auto``, checked before any work."""
    from memtrain.units import parse_size

    if budget is None or budget == "auto":
        return
    try:
        if parse_size(budget) <= 0:
            raise ValueError("a budget must be more than 0 bytes")
    except ValueError as err:
        raise MemtrainError(f"`--budget` must look like '24GiB', '512MiB' or 'auto', got {budget!r} "
                            f"({err}). Fix: a positive size with a unit, e.g. --budget 24GiB.") from None


def _check_plot(plot: Path | None, sweep: bool) -> None:
    """``--plot`` draws the ``--sweep`` curves into a folder that exists."""
    if plot is None:
        return
    if not sweep:
        raise MemtrainError("`--plot` saves the curves of `--sweep`, which was not given. Fix: add "
                            "`--sweep`, or leave out `--plot`.")
    if not plot.parent.is_dir():
        raise MemtrainError(f"`--plot`: the folder {str(plot.parent)!r} does not exist. Fix: create it, "
                            "or give a path in an existing folder.")


def _write_figure(fig: Any, path: Path, what: str) -> None:
    """Save a matplotlib figure; a folder that cannot be written is a user error, not a traceback."""
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise MemtrainError(f"{what}: cannot write {str(path)!r} ({err.strerror or err}). Fix: give a "
                            "path in a folder you can write to.") from None


_NOISY_LOGGERS = ("torchao", "bitsandbytes", "torch.utils._pytree", "datasets", "peft")


@app.callback()
def _quiet_libraries() -> None:
    """Keep import-time chatter of optional backends out of the user's terminal."""
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Could not find a config file.*")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False, show_time=False)],
        force=True,
    )
    logging.getLogger("memtrain").setLevel(logging.INFO)


@app.command()
@user_errors
def train(recipe: Recipe, overrides: Overrides = None,
          verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
          nproc: Annotated[int | None, typer.Option(
              "--nproc", min=1, help="Processes to train with (sets `distributed.processes`): one per "
              "GPU, sharded with FSDP2; on CPU they share the cores.")] = None) -> None:
    """Fine-tune as a recipe says: data, model, adapter, memory techniques, training, saving."""
    from memtrain.config import load_recipe
    from memtrain.runner import train as run_training

    _setup_logging(verbose)
    extra = [f"distributed.processes={nproc}"] if nproc is not None else []
    cfg = load_recipe(recipe, [*(overrides or []), *extra])
    run_training(cfg, console=console)


@app.command()
@user_errors
def validate(recipe: Recipe, overrides: Overrides = None) -> None:
    """Check a recipe and print it fully resolved (every default filled in)."""
    from memtrain.config import dump_recipe, load_recipe

    cfg = load_recipe(recipe, overrides or [])
    console.print(dump_recipe(cfg), highlight=False, markup=False)
    err_console.print(f"[green]ok:[/] {recipe} is a valid recipe")


@app.command()
@user_errors
def recipes() -> None:
    """List the recipes that ship with memtrain."""
    import yaml

    from memtrain.config import shipped_recipes_dir

    table = Table("recipe", "description", title=f"recipes in {shipped_recipes_dir()}")
    for path in sorted(shipped_recipes_dir().glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        table.add_row(path.stem, str(data.get("description", "")))
    console.print(table)


@app.command()
@user_errors
def datasets() -> None:
    """List the offline datasets built into memtrain (`data.source: builtin:<name>`)."""
    from memtrain.builtin_data import BUILTINS

    table = Table("source", "description")
    for name, builder in BUILTINS.items():
        doc = (builder.__doc__ or "").strip().splitlines()[0]
        table.add_row(f"builtin:{name}", doc)
    console.print(table)


@app.command()
@user_errors
def estimate(
    recipe: Recipe,
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
    sweep: Annotated[bool, typer.Option(
        "--sweep", help="Also show peak memory against micro-batch size and sequence length.")] = False,
    device: Annotated[str | None, typer.Option(
        help="Where the run will train: cuda or cpu (default: this machine's device).")] = None,
    exact: Annotated[bool, typer.Option(
        "--exact", help="Trace every layer instead of extrapolating from 2 and 3 (slower).")] = False,
    plot: Annotated[Path | None, typer.Option(help="With --sweep: save the curves to this PNG.")] = None,
) -> None:
    """Predict peak memory by category and phase, without loading weights or using the network."""
    from memtrain.memory import estimate as est

    _check_device(device)
    _check_plot(plot, sweep)
    result = est.estimate(recipe, overrides or [], device=device, exact=exact)
    curves = est.sweep(recipe, overrides or [], device=device) if sweep else None
    if as_json:
        out = result.to_dict() | ({"sweep": curves.to_dict()} if curves else {})
        console.print_json(json.dumps(out))
    else:
        _print_estimate(result)
        if curves:
            _print_sweep(curves)
    if curves and plot:
        _plot_sweep(curves, plot, result.model)
        err_console.print(f"curves saved to {plot}")


@app.command()
@user_errors
def plan(
    recipe: Recipe,
    overrides: Overrides = None,
    budget: Annotated[str | None, typer.Option(
        help="Memory per device, like 24GiB (default: memory.budget, else the free memory).")] = None,
    device: Annotated[str | None, typer.Option(
        help="Where the run will train: cuda or cpu (default: this machine's device).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    tune: Annotated[int, typer.Option(
        min=0, help="Time this many of the fastest-predicted settings, at up to four micro-batches that fit, "
        "with real steps here and keep the fastest measured (builds the model).")] = 0,
) -> None:
    """Choose the `auto` settings: the fastest combination whose predicted peak fits the budget."""
    from memtrain import planner
    from memtrain.config import load_recipe
    from memtrain.plan_view import print_plan

    _check_device(device)
    _check_budget(budget)
    cfg = load_recipe(recipe, overrides or [])
    result = planner.plan(cfg, budget, device=device, tune=tune)
    if as_json:
        console.print_json(json.dumps(planner.describe(result), default=str))
    else:
        print_plan(console, result)
        overrides_line = " ".join(f"{k}={_yaml_value(v)}" for k, v in result.settings().items())
        console.print(f"train with: memtrain train {recipe} {overrides_line}", highlight=False)


def _yaml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items() if v is not None) + "}"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _print_estimate(result: Any) -> None:
    from memtrain.units import format_bytes as fmt

    s = result.settings
    title = (f"{result.model}: {result.parameters:,} parameters, {result.trainable:,} trainable; "
             f"{s['adapter']} {s['dtype']} quant={s['quantization']} {s['optimizer']}, micro-batch "
             f"{s['micro_batch_size']} x {s['seq_len']} tokens, checkpointing={s['checkpointing']}")
    phases = list(result.by_phase)
    table = Table("category", "at the peak", *[f"{p} peak" for p in phases], title=title,
                  title_justify="left")
    for name, value in result.by_category.items():
        table.add_row(name, fmt(value), *[fmt(result.category_at_phase_peak[p][name]) for p in phases])
    table.add_row("[bold]live tensors[/]", f"[bold]{fmt(result.peak_bytes)}[/]",
                  *[fmt(result.by_phase[p]) for p in phases])
    console.print(table)
    lines = Table("line", "bytes", "source", title=f"{result.device} memory", title_justify="left")
    lines.add_row("live tensors at the peak", fmt(result.peak_bytes), result.method)
    for name, value in result.overheads.items():
        lines.add_row(name, fmt(value), result.overhead_sources[name])
    lines.add_row(f"[bold]total on {result.device}[/]", f"[bold]{fmt(result.total_bytes)}[/]", "")
    if result.host_peak_bytes:
        lines.add_row("host (offloaded tensors)", fmt(result.host_peak_bytes), "separate from the device"
                      if result.device != "cpu" else "the same RAM: in the total (host_offload)")
    console.print(lines)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(f"estimated in {result.seconds:.1f} s", style="dim")


def _print_sweep(curves: Any) -> None:
    from memtrain.units import format_bytes as fmt

    for axis, points in (("micro-batch size", curves.micro_batch_size), ("sequence length", curves.seq_len)):
        table = Table(axis, "live tensors", "total", title=f"peak vs {axis}", title_justify="left")
        for value, peak, total in points:
            table.add_row(str(value), fmt(peak), fmt(total))
        console.print(table)


def _plot_sweep(curves: Any, path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (label, points) in zip(axes, (("micro-batch size", curves.micro_batch_size),
                                          ("sequence length", curves.seq_len)), strict=True):
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] / 2**30 for p in points], marker="o", label="live tensors")
        ax.plot(xs, [p[2] / 2**30 for p in points], marker="o", label="total")
        ax.set_xlabel(label)
        ax.set_ylabel("GiB")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"predicted peak memory: {model}")
    fig.tight_layout()
    try:
        _write_figure(fig, path, "`--plot`")
    finally:
        plt.close(fig)


@app.command()
@user_errors
def calibrate(
    output: Annotated[Path | None, typer.Option(
        help="Where to save the profile (default: $MEMTRAIN_CALIBRATION or ~/.cache/memtrain).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Shorter, rougher measurements.")] = False,
) -> None:
    """Measure this machine's GPU memory overheads and speed rates for the estimator and planner."""
    from memtrain.memory.calibrate import calibrate as run_calibration
    from memtrain.units import format_bytes as fmt

    profile = run_calibration(output, quick)
    table = Table("device", "measure", "value", title="calibration", title_justify="left")
    for device, rates in profile["rates"].items():
        for dtype, flops in rates["matmul_flops"].items():
            table.add_row(device, f"matmul {dtype}", f"{flops / 1e12:.2f} TFLOP/s")
        for key in ("memory_bandwidth", "host_to_device_bandwidth", "device_to_host_bandwidth"):
            if key in rates:
                table.add_row(device, key.replace("_", " "), f"{rates[key] / 1e9:.1f} GB/s")
    overheads = profile["overheads"] or {}
    if "cuda_context_bytes" in overheads:
        table.add_row(overheads["device"], "CUDA context", fmt(overheads["cuda_context_bytes"]))
    if "fragmentation" in overheads:
        table.add_row(overheads["device"], "allocator fragmentation", f"{overheads['fragmentation']:.1%}")
    console.print(table)
    for note in profile["notes"]:
        console.print(f"note: {note}", highlight=False)
    console.print(f"saved to {profile['path']}")


@app.command()
@user_errors
def report(run_dir: Annotated[str, typer.Argument(help="The output folder of a finished run.")]) -> None:
    """Re-render a run's memory report (PNG) and print its summary table."""
    from pathlib import Path

    from memtrain.report import REPORT_PNG, load_report, render_png, summary_rows

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
    console.print(f"plot: {folder / REPORT_PNG}")


RunDir = Annotated[str, typer.Argument(help="The output folder of a finished run.")]


@app.command()
@user_errors
def merge(run_dir: RunDir, out: Annotated[Path | None, typer.Option(
        help="Folder for the merged model (default: RUN_DIR/merged).")] = None) -> None:
    """Fold a run's LoRA adapter into the base weights (a 4-bit base is dequantized first) and save
    an ordinary Hugging Face model folder."""
    from memtrain.inference import merge as merge_run

    folder = merge_run(run_dir, out)
    console.print(f"merged model saved to {folder}", highlight=False)


@app.command()
@user_errors
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
    from memtrain.inference import generate as run_generate
    from memtrain.inference import load_run

    run = load_run(run_dir)
    if prompt is not None:
        console.print(run_generate(run, prompt, max_new_tokens, temperature, input_text),
                      highlight=False, markup=False)
        return
    chat = run.cfg.data.kind in ("messages", "sharegpt")
    history: list[dict[str, str]] = []
    for line in sys.stdin:
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        answer = run_generate(run, history if chat else line.strip(), max_new_tokens, temperature)
        history.append({"role": "assistant", "content": answer})
        console.print(f"> {answer}", highlight=False, markup=False)


@app.command()
@user_errors
def predict(
    run_dir: RunDir,
    file: Annotated[Path, typer.Argument(help="Texts to classify (.jsonl, .json, .csv, .parquet, "
                                         ".txt), in the run's `data.text_column`.")],
    out: Annotated[Path | None, typer.Option(
        help="Where to write predictions: .csv or .jsonl (default: print JSON lines).")] = None,
) -> None:
    """Label texts with a trained classifier: the label, its probability and every class's."""
    from memtrain.inference import load_run, read_texts, write_rows
    from memtrain.inference import predict as run_predict

    run = load_run(run_dir)
    rows = run_predict(run, read_texts(run, file))
    if out is None:
        for row in rows:
            console.print(json.dumps(row), highlight=False, markup=False, soft_wrap=True)
    else:
        write_rows(rows, out)
        err_console.print(f"{len(rows)} predictions written to {out}")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
