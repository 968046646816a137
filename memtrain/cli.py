"""The ``memtrain`` command: each subcommand parses arguments and calls one library function.

User mistakes (:class:`MemtrainError`) print their message and exit with status 2, without a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from functools import wraps
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
def report(run_dir: Annotated[str, typer.Argument(help="The output folder of a finished run.")]) -> None:
    """Re-render a run's memory report (PNG) and print its summary table."""
    from pathlib import Path

    from memtrain.report import REPORT_PNG, load_report, render_png, summary_rows

    folder = Path(run_dir)
    loaded = load_report(folder)
    render_png(loaded, folder / REPORT_PNG)
    table = Table("category", "measured at peak", "predicted", "error",
                  title=f"memory of one training step — {loaded.measured['device']}")
    for row in summary_rows(loaded):
        table.add_row(*row)
    console.print(table)
    console.print(f"plot: {folder / REPORT_PNG}")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
