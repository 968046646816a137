"""Show a :class:`memtrain.plan.planner.Plan` as tables: the choice, the next best, and why not the rest."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from memtrain.plan.planner import Candidate, Plan
from memtrain.units import format_bytes

SHOWN_ALTERNATIVES = 4


def print_plan(console: Console, plan: Plan) -> None:
    """Print the decision, its predicted memory and time, the alternatives and the rejections."""
    fields = ", ".join(f"`{f}`" for f in plan.auto) or "none (checking the recipe as written)"
    console.print(f"[bold]plan[/] for {format_bytes(plan.usable)} usable of a {format_bytes(plan.budget)} "
                  f"budget on {plan.device}; deciding {fields}", highlight=False)
    if plan.length is not None:
        console.print(plan.length.explain(), highlight=False)
        needed = _settings(plan.chosen)
        console.print(f"at {plan.length.chosen:,} tokens the fastest that fits: {needed}", highlight=False)
    tuned = plan.chosen.measured is not None
    measured = ("measured s/step",) if tuned else ()
    table = Table("", "settings", "predicted peak", "predicted s/step", *measured, title_justify="left",
                  title="chosen, then the next best that fit")

    def cells(cand: Candidate) -> tuple[str, ...]:
        timed = (f"{cand.measured:.3g}" if cand.measured is not None else "not timed",) if tuned else ()
        return _settings(cand), format_bytes(cand.peak), f"{cand.seconds:.3g}", *timed

    table.add_row("[bold green]chosen[/]", *cells(plan.chosen))
    for cand in plan.alternatives[:SHOWN_ALTERNATIVES]:
        table.add_row("", *cells(cand))
    console.print(table)
    if plan.rejected:
        kinds = Counter(c.reason.split(":")[0] for c in plan.rejected)
        summary = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
        console.print(f"rejected: {summary}", highlight=False)
        for cand in plan.rejected[:SHOWN_ALTERNATIVES]:
            console.print(f"  {_settings(cand)}: {cand.reason}", highlight=False)
    if plan.host is not None:
        kept = (f"{format_bytes(plan.chosen.host)} of {format_bytes(plan.host.usable)} usable"
                if plan.chosen.host else f"nothing of {format_bytes(plan.host.usable)} usable")
        console.print(f"host RAM of the choice (offloaded tensors): {kept} (`memory.host_budget` "
                      f"{plan.host.setting} = {format_bytes(plan.host.total)}, "
                      f"{plan.host.margin:.0%} margin)", highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", style="yellow", highlight=False)
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in plan.chosen.parts.items() if v > 0)
    console.print(f"step time of the choice: {parts}", style="dim", highlight=False)
    console.print(f"speed rates: {plan.rates_source}; planned in {plan.seconds:.1f} s", style="dim",
                  highlight=False)


def _settings(cand: Candidate) -> str:
    return cand.label() or "the recipe as written"
