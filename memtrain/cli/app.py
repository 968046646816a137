"""The ``memtrain`` command: each subcommand parses arguments and calls one library function.

User mistakes (:class:`MemtrainError`) print their message and exit with status 2, without a
traceback; anything else is a bug and keeps its traceback. This module holds the app and the
commands of a recipe's life (train, validate, recipes, datasets); :mod:`memtrain.cli.estimate`
(estimate, plan, calibrate) and :mod:`memtrain.cli.runs` (report, merge, generate, predict) the
others, with what they share in :mod:`memtrain.cli.common`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Annotated

import typer
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from memtrain import allocator, lazy_setup
from memtrain._compat.versions import check_versions
from memtrain.cli import estimate as cli_estimate
from memtrain.cli import runs as cli_runs
from memtrain.cli.common import (
    Overrides,
    Recipe,
    console,
    err_console,
    user_errors,
)
from memtrain.errors import MemtrainError, first_line

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Fine-tune Hugging Face models under a memory budget.",
)


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
              "--nproc", min=1, help="Processes to train with (sets `distributed.processes`; with several "
              "`distributed.nodes`, over all machines): one per GPU, sharded with FSDP2; on CPU they "
              "share the cores.")] = None) -> None:
    """Fine-tune as a recipe says: data, model, adapter, memory techniques, training, saving."""
    with lazy_setup.importing():
        from memtrain.config import load_recipe
        from memtrain.run.train import train as run_training

    _setup_logging(verbose)
    given = [o.split("=", 1)[1].strip() for o in overrides or [] if o.split("=", 1)[0].strip() ==
             "distributed.processes"]
    if nproc is not None and given and given[-1] != str(nproc):
        raise MemtrainError(f"`--nproc {nproc}` and `distributed.processes={given[-1]}` ask for different "
                            "numbers of processes. Fix: give one of them.")
    extra = [f"distributed.processes={nproc}"] if nproc is not None else []
    cfg = load_recipe(recipe, [*(overrides or []), *extra])
    run_training(cfg, console=console)


@app.command()
@user_errors
def validate(recipe: Recipe, overrides: Overrides = None,
             data: Annotated[bool, typer.Option(
                 "--data", help="Also read, render and tokenize the recipe's data (the tokenizer, no "
                 "model), as `memtrain train` does, and report every bad row.")] = False,
             show: Annotated[bool, typer.Option(
                 "--show", help="Then print the recipe fully resolved (every default filled in), as "
                 "YAML on stdout.")] = False) -> None:
    """Check a recipe: every mistake at once, each with its fix (with --data, its data's too).

    The model is checked from its config, without weights: `data.max_length` within its
    positions, and each technique the recipe fixes applies to it (a fake build).
    """
    with lazy_setup.importing():
        from memtrain.config import RecipeError, dump_recipe, load_recipe
        from memtrain.estimator.setup import check_max_length
        from memtrain.plan.search import check_patches

    found: list[MemtrainError] = []
    try:
        cfg = load_recipe(recipe, overrides or [])
    except RecipeError as err:  # a missing file alone leaves a valid recipe to check the model of
        try:
            cfg = load_recipe(recipe, overrides or [], require=())
        except RecipeError:
            raise err from None
        found.append(err)
    loaded = not found  # every file the recipe names exists
    model_found = not any(p.path.startswith("model.") for e in found if isinstance(e, RecipeError)
                          for p in e.problems)

    def check(stage: Callable[[], object]) -> object:  # every stage runs: one hides no other
        try:
            return stage()
        except MemtrainError as err:
            found.append(err)
            return None

    if model_found:  # the model's config at hand
        check(lambda: check_max_length(cfg))  # within its positions (its config: no weights, no network)
        check(lambda: check_patches(cfg))  # each fixed technique finds what it patches (a fake model)
    read = prepared = None
    if data and loaded:  # the data, when every file it needs is there
        from memtrain.data.check import check_data

        if (checked := check(lambda: check_data(cfg))) is not None:
            line, prepared = checked
            read = f"data read: {line}"
    if cfg.training.objective == "grpo":  # loss type, rewards (with --data: called on the first row), lengths
        from memtrain.estimator.grpo import check_grpo

        check(lambda: check_grpo(cfg, prepared))  # the prompts as read (uncut with an `auto` length)
    if found:
        raise _all_problems(recipe, found)
    read = read or "its data was not read (--data reads it)"
    err_console.print(f"[green]ok:[/] {recipe} is a valid recipe; {escape(read)}", highlight=False,
                      soft_wrap=True)
    if show:  # not wrapped to the terminal: the YAML stays valid when saved
        console.print(dump_recipe(cfg), highlight=False, markup=False, soft_wrap=True)


def _all_problems(recipe: str, found: list[MemtrainError]) -> MemtrainError:
    """One error listing what every stage of ``validate`` found (the one error itself when alone)."""
    from memtrain.config import RecipeError

    if len(found) == 1:
        return found[0]
    items = [str(p) for err in found for p in (err.problems if isinstance(err, RecipeError) else [err])]
    lines = "\n".join("  - " + item.replace("\n", "\n    ") for item in items)
    return MemtrainError(f"{recipe}: {len(items)} problems:\n{lines}")


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


# The other command groups live in their own modules; registered here in the order `--help` lists.
for _command in (cli_estimate.estimate, cli_estimate.plan, cli_estimate.calibrate, cli_runs.report,
                 cli_runs.merge, cli_runs.generate, cli_runs.predict):
    app.command()(user_errors(_command))


def main() -> None:
    """Console-script entry point."""
    atexit.register(_end_without_teardown)  # registered first, so it runs after every other one
    lazy_setup.install()  # before any command imports torch's and Hugging Face's libraries
    allocator.set_default()  # before CUDA starts: this process and every worker it launches
    check_versions()  # once: a dependency outside the tested range (memtrain._compat.versions)
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        _exit_code[0] = 130
        sys.exit(130)
    except SystemExit as done:
        _exit_code[0] = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        raise
    except Exception as err:  # a bug, not a user mistake: its traceback, its message, status 1
        # Caught here because the exit handler below leaves through os._exit: an exception left to
        # the interpreter would print its traceback and still exit with status 0.
        traceback.print_exc()
        what = f"{type(err).__name__}: {first_line(err)}"
        err_console.print(f"[bold red]internal error:[/] {escape(what)} (a bug in memtrain or a library "
                          "it uses; the traceback above says where)", highlight=False, soft_wrap=True)
        _exit_code[0] = 1
        sys.exit(1)


_exit_code = [0]


def _end_without_teardown() -> None:
    """Leave the process once the command's work and every exit handler are done, skipping the
    interpreter's teardown: freeing every object of torch, transformers and friends one by one
    takes about 2 s on a 2-core machine (11.0 s vs 9.3 s for `import memtrain.estimator.estimate`
    alone), a sixth of a 70B estimate, and frees nothing the operating system would not. The
    handlers of modules imported before :func:`main` (logging's) run here, as they would after."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`memtrain ... | head`)
            stream.flush()
    os._exit(_exit_code[0])
