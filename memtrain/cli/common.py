"""What every ``memtrain`` subcommand module shares: the consoles, argument types, user errors.

User mistakes (:class:`MemtrainError`) print their message and exit with status 2, without a
traceback (:func:`user_errors`); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
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
            text = str(err)
            recipe = kwargs.get("recipe")
            if getattr(err, "source", None) == "recipe" and isinstance(recipe, str):
                # a recipe's problem found after loading it (e.g. building the model's config): name its file
                text = recipe + text[len("recipe"):]
            err_console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)
            raise typer.Exit(err.exit_code) from None

    return wrapper  # type: ignore[return-value]
