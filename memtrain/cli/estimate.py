"""``memtrain estimate``, ``memtrain plan`` and ``memtrain calibrate``: predictions, no training."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from memtrain import lazy_setup
from memtrain.cli.common import (
    Overrides,
    Recipe,
    console,
    err_console,
)
from memtrain.errors import MemtrainError

ReadData = Annotated[bool, typer.Option(
    "--data", help="Read and tokenize the recipe's data and predict its longest batch (as `memtrain "
    "train` does), instead of rows of data.max_length tokens.")]


def _check_device(device: str | None) -> None:
    """``--device`` must be a device memtrain plans for."""
    if device is None or device in ("cpu", "cuda") or (
            device.startswith("cuda:") and device.removeprefix("cuda:").isdigit()):
        return
    raise MemtrainError(f"`--device` must be cpu, cuda or cuda:N, got {device!r}. Fix: use one of those "
                        "(memtrain does not plan for other devices).")


def _check_budget(budget: str | None) -> None:
    """``--budget`` must be a size or ``auto``, checked before any work."""
    from memtrain.units import budget_problem

    if budget is not None and (why := budget_problem(budget)) is not None:
        raise MemtrainError(f"`--budget` {why}, got {budget!r}. Fix: a positive size with a unit, e.g. "
                            "--budget 24GiB.")


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


def _data_rows(cfg: Any) -> Any:
    """The longest batch of the recipe's data (``--data``), said on stderr."""
    from memtrain.data.prepare import read_rows

    rows = read_rows(cfg)
    err_console.print(f"data read: the longest row is {rows.longest} tokens "
                      f"(data.max_length = {cfg.data.max_length})", highlight=False)
    return rows


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
    data: ReadData = False,
) -> None:
    """Predict peak memory by category and phase, without loading weights or using the network."""
    with lazy_setup.importing():
        from memtrain.config import load_recipe
        from memtrain.estimator import estimate as est
        from memtrain.estimator.setup import check_decided
        from memtrain.plan.autofit import for_estimate
        from memtrain.reliability.budget import HostBudget

    _check_device(device)
    _check_plot(plot, sweep)
    cfg = load_recipe(recipe, overrides or [])
    batch = ("training.micro_batch_size", "training.gradient_accumulation")
    check_decided(cfg, allow=batch if cfg.training.micro_batch_size == "auto" else ())  # before the data
    rows = _data_rows(cfg) if data else None
    cfg, chosen = for_estimate(cfg, device, rows)  # micro_batch_size: auto, the largest that fits
    result = est.estimate(cfg, device=device, exact=exact, rows=rows)
    if chosen:
        result.notes.insert(0, chosen)
    if cfg.training.objective == "grpo":  # what is and is not predicted (issue 38)
        from memtrain.estimator.grpo import check_grpo
        from memtrain.estimator.grpo_step import grpo_notes

        check_grpo(cfg)
        resident = sum(result.by_category.get(name, 0)  # what generation runs beside
                       for name in ("parameters", "buffers", "optimizer_state"))
        result.notes[:0] = grpo_notes(cfg, result.device, result.settings["seq_len"], resident)
    host = HostBudget.of(cfg.memory)
    curves = est.sweep(cfg, device=device) if sweep else None
    if as_json:
        out = result.to_dict() | {"host_budget": host.setting, "host_budget_bytes": host.total,
                                  "host_usable_bytes": host.usable}
        out |= {"sweep": curves.to_dict()} if curves else {}
        console.print_json(json.dumps(out))
    else:
        _print_estimate(result, host)
        if curves:
            _print_sweep(curves)
    if curves and plot:
        _plot_sweep(curves, plot, result.model)
        err_console.print(f"curves saved to {plot}")


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
    data: ReadData = False,
    alternatives: Annotated[bool, typer.Option(
        "--alternatives", help="Also trace the settings that cannot change the choice (predicted no "
        "faster, with more memory techniques) and list them: slower; the same choice.")] = False,
) -> None:
    """Choose the `auto` settings: the fastest combination whose predicted peak fits the budget."""
    with lazy_setup.importing():
        from memtrain.config import load_recipe
        from memtrain.plan import planner
        from memtrain.plan.view import print_plan

    _check_device(device)
    _check_budget(budget)
    cfg = load_recipe(recipe, overrides or [])
    result = planner.plan(cfg, budget, device=device, tune=tune, rows=_data_rows(cfg) if data else None,
                          alternatives=alternatives)
    if as_json:
        console.print_json(json.dumps(planner.describe(result), default=str))
    else:
        print_plan(console, result)
        console.print(f"train with: {train_command(recipe, overrides or [], result.settings())}",
                      highlight=False, markup=False, soft_wrap=True)  # one line, as typed


def train_command(recipe: str, overrides: list[str], settings: dict[str, Any]) -> str:
    """The `memtrain train` command of a plan: the overrides the plan was made with (those it
    decides replaced by its settings), then its settings, each quoted for the shell."""
    kept = [o for o in overrides if o.split("=", 1)[0].strip() not in settings]
    decided = [f"{k}={_yaml_value(v)}" for k, v in settings.items()]
    return shlex.join(["memtrain", "train", recipe, *kept, *decided])


def _yaml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items() if v is not None) + "}"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _print_estimate(result: Any, host: Any) -> None:
    from memtrain.units import format_bytes as fmt

    s = result.settings
    title = (f"{result.model}: {result.parameters:,} parameters, {result.trainable:,} trainable; "
             f"{s['adapter']} {s['dtype']} quant={s['quantization']} {s['optimizer']}, micro-batch "
             f"{s['micro_batch_size']} x {s['seq_len']} tokens, checkpointing={s['checkpointing']}")
    if s.get("processes", 1) > 1:
        title += f"; one of {s['processes']} processes, sharding={s['sharding']}"
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
        lines.add_row("host budget", fmt(host.usable), f"`memory.host_budget` {host.setting} = "
                      f"{fmt(host.total)} less the {host.margin:.0%} margin")
    console.print(lines)
    if not host.fits(result.host_peak_bytes):
        console.print(f"[bold red]does not fit the host:[/] {host.shortfall(result.host_peak_bytes)}",
                      highlight=False)
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


def calibrate(
    output: Annotated[Path | None, typer.Option(
        help="Where to save the profile (default: $MEMTRAIN_CALIBRATION or ~/.cache/memtrain).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Shorter, rougher measurements.")] = False,
) -> None:
    """Measure this machine's GPU memory overheads and speed rates for the estimator and planner."""
    with lazy_setup.importing():
        from memtrain.estimator.calibrate import calibrate as run_calibration
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
    if "cuda_workspace_bytes" in overheads:
        table.add_row(overheads["device"], "cuBLAS workspaces", fmt(overheads["cuda_workspace_bytes"]))
    if "fragmentation" in overheads:
        under = overheads.get("allocator", "default settings")
        table.add_row(overheads["device"], f"allocator fragmentation ({under})",
                      f"{overheads['fragmentation']:.1%}")
    console.print(table)
    for note in profile["notes"]:
        console.print(f"note: {note}", highlight=False)
    console.print(f"saved to {profile['path']}")
