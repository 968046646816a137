"""What every ``memtrain`` subcommand module shares: the consoles, argument types, checks.

User mistakes (:class:`MemtrainError`) print their message and exit with status 2, without a
traceback (:func:`user_errors`); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from memtrain.errors import MemtrainError

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

Recipe = Annotated[str, typer.Argument(help="Recipe YAML file, or the name of a shipped recipe.")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Overrides like `training.learning_rate=1e-4 data.max_examples=500`."),
]
RunDir = Annotated[str, typer.Argument(help="The output folder of a finished run.")]


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
