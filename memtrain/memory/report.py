"""Memory reports a person can look at: ``memory_report.json`` and ``memory_report.png``.

The JSON holds the measured step (peak by category and phase, the per-op timeline, the shape of its
largest micro-batch), the estimator's prediction for the run's longest batch, and the loss and
memory curves of the run. Measured and predicted are compared for the same batch shape: the meter
measures the step that holds the run's longest batch (:mod:`memtrain.trainer.callbacks`); where the
run never held it (``max_steps`` ended it first), ``same_batch`` holds a second prediction for the
batch that was measured, and the comparison uses that. :func:`comparison` says which. The PNG
draws the measured step as stacked categories over its op timeline with the prediction beside
it, and the curves over the run. ``memtrain report RUN_DIR`` re-renders both from the JSON.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtrain.errors import MemtrainError
from memtrain.memory.meter import StepMemory
from memtrain.memory.trackers import CATEGORY_NAMES, PHASES
from memtrain.units import format_bytes

REPORT_JSON, REPORT_PNG = "memory_report.json", "memory_report.png"
MAX_TIMELINE_POINTS = 4000  # enough for a smooth plot; keeps the JSON small
_COLORS = {
    "parameters": "#4c72b0", "buffers": "#8c8c8c", "gradients": "#dd8452", "optimizer_state": "#c44e52",
    "activations": "#55a868", "temporaries": "#ccb974", "inputs": "#64b5cd", "unsharded": "#8172b3",
}


@dataclass
class Report:
    """Everything a report shows; :func:`build_report` makes one, :func:`load_report` reads one."""

    measured: dict[str, Any]
    predicted: dict[str, Any] | None
    curves: dict[str, list[list[float]]]
    run: dict[str, Any]
    same_batch: dict[str, Any] | None = None  # the prediction for the measured step's batch, if it differs

    def compared(self) -> dict[str, Any] | None:
        """The prediction the measured step is compared with: for the same batch shape."""
        return self.same_batch or self.predicted

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1)


def build_report(step: StepMemory, log_history: list[dict[str, Any]], predicted: dict[str, Any] | None,
                 run: dict[str, Any], same_batch: dict[str, Any] | None = None) -> Report:
    """Assemble a report from a measured step, the Trainer's log history and a prediction.

    ``predicted`` and ``same_batch`` carry the batch they are for as ``batch: [rows, tokens]``;
    ``same_batch`` is the prediction for the measured step's batch when it is not the predicted one.
    """
    measured = step.to_dict(timeline=False)
    timeline = step.timeline
    stride = max(1, len(timeline) // MAX_TIMELINE_POINTS)
    measured["timeline"] = [[phase, [snap.get(c, 0) for c in CATEGORY_NAMES]]
                           for phase, snap in timeline[::stride]]
    curves = {
        "loss": [[h["step"], h["loss"]] for h in log_history if "loss" in h],
        "eval_loss": [[h["step"], h["eval_loss"]] for h in log_history if "eval_loss" in h],
        "peak_mib": [[h["step"], h["memory/peak_mib"]] for h in log_history if "memory/peak_mib" in h],
    }
    run = {**run, "python": platform.python_version(), "machine": platform.machine()}
    return Report(measured, predicted, curves, run, same_batch)


def comparison(report: Report) -> str:
    """One sentence: which batch was measured and which prediction it is compared with."""
    if not report.predicted:
        return "no prediction to compare with"
    measured, predicted = report.measured.get("batch"), report.predicted.get("batch")
    worst = format_bytes(report.predicted["peak_bytes"])
    if not measured or not predicted:
        return (f"measured: the step with the highest peak, whose batch shape is not known (GRPO: its "
                f"completions are generated in the step); predicted {worst} for the worst case, "
                f"{_shape(predicted)}: the comparison is not like for like")
    ratio = _ratio(report.compared(), report.measured["peak_bytes"])
    # the reported step is unlike the run's others only where no measured step was like them
    failed = ("; the measured step also held an attempt that ran out of memory before it was split, so it "
              "measures more than the step" if report.measured.get("failed_attempt") else
              "; the measured step is the run's first, before the optimizer's state exists, which the "
              "prediction (a later step) holds" if report.measured.get("before_optimizer_state") else "")
    if list(measured) == list(predicted):
        return (f"measured the step that held the run's longest batch, {_shape(measured)}; the prediction "
                f"is for the same batch{ratio}{failed}")
    same = (f"compared with the prediction for that batch{ratio}" if report.same_batch else
            "no prediction for that batch: the comparison is not like for like")
    if list(report.run.get("largest_batch") or []) == list(predicted):  # held, in an unlike step only
        return (f"the run held its predicted longest batch ({_shape(predicted)}, {worst}) only in a step "
                "unlike its others (its first, before the optimizer's state exists, or one redone after "
                f"an out-of-memory error); measured the largest of the others, {_shape(measured)}; {same}")
    return (f"the run never held its predicted longest batch ({_shape(predicted)}, {worst}); measured "
            f"its largest, {_shape(measured)}; {same}{failed}")


def _shape(batch: Any) -> str:
    if batch and len(batch) == 3:  # GRPO's generated batch
        return f"{batch[0]} completions of {batch[2]} tokens after {batch[1]}-token prompts"
    return f"{batch[0]} rows x {batch[1]} tokens" if batch else "batch shape unknown"


def _ratio(predicted: dict[str, Any] | None, measured: int) -> str:
    if not predicted or not measured:
        return ""
    return f" (predicted / measured = {predicted['peak_bytes'] / measured:.3f})"


def save_report(report: Report, out_dir: Path) -> tuple[Path, Path]:
    """Write the JSON and the PNG into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / REPORT_JSON
    json_path.write_text(report.to_json(), encoding="utf-8")
    png_path = out_dir / REPORT_PNG
    render_png(report, png_path)
    return json_path, png_path


def load_report(run_dir: Path) -> Report:
    """Read ``memory_report.json`` from a run folder."""
    path = run_dir / REPORT_JSON
    if not path.is_file():
        raise MemtrainError(f"{run_dir} has no {REPORT_JSON}. Fix: point to the `output.dir` of a "
                            "finished `memtrain train` run (with `output.report: true`).")
    try:
        return Report(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as err:
        raise MemtrainError(f"{path} is not a memtrain report ({err}).") from None


def summary_rows(report: Report) -> list[tuple[str, str, str, str]]:
    """(category, measured at peak, predicted, error %) rows for a summary table."""
    measured = report.measured["peak_by_category"]
    compared = report.compared() or {}
    predicted = compared.get("by_category", {})
    rows = []
    for name in CATEGORY_NAMES:
        m, p = measured.get(name, 0), predicted.get(name)
        if not m and not p:
            continue
        err = f"{(p - m) / m:+.1%}" if p is not None and m else ""
        rows.append((name, format_bytes(m), format_bytes(p) if p is not None else "-", err))
    total_m, total_p = report.measured["peak_bytes"], compared.get("peak_bytes")
    err = f"{(total_p - total_m) / total_m:+.1%}" if total_p else ""
    rows.append(("peak (device)", format_bytes(total_m), format_bytes(total_p) if total_p else "-", err))
    if report.same_batch and report.predicted:
        rows.append(("peak, the longest batch", "-", format_bytes(report.predicted["peak_bytes"]), ""))
    if report.measured.get("host_peak_bytes"):
        rows.append(("peak (host)", format_bytes(report.measured["host_peak_bytes"]), "-", ""))
    return rows


def render_png(report: Report, path: Path) -> None:
    """Draw the step timeline by category (with the prediction) and the run's curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_run) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=[1.6, 1])
    _draw_step(ax_step, report)
    _draw_run(ax_run, report)
    title = report.run.get("title", "memtrain run")
    fig.suptitle(f"{title} — {report.measured['device']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_step(ax: Any, report: Report) -> None:
    timeline = report.measured.get("timeline") or []
    mib = 2**20
    if timeline:
        xs = list(range(len(timeline)))
        stacks = [[point[1][i] / mib for point in timeline] for i in range(len(CATEGORY_NAMES))]
        ax.stackplot(xs, stacks, labels=CATEGORY_NAMES, colors=[_COLORS[c] for c in CATEGORY_NAMES],
                     alpha=0.85)
        start = 0
        for i in range(1, len(timeline) + 1):  # label each phase span
            if i == len(timeline) or timeline[i][0] != timeline[start][0]:
                ax.axvspan(start, i, color="k", alpha=0.04 if PHASES.index(timeline[start][0]) % 2 else 0)
                ax.text((start + i) / 2, 0, timeline[start][0], ha="center", va="bottom", fontsize=7)
                start = i
    ax.axhline(report.measured["peak_bytes"] / mib, color="k", lw=1, label="measured peak")
    compared = report.compared()
    if compared:
        ax.axhline(compared["peak_bytes"] / mib, color="m", lw=1.5, ls="--",
                   label=f"predicted peak, {_shape(compared.get('batch'))}")
    host = report.measured.get("host_peak_bytes") or 0
    if host:
        ax.axhline(host / mib, color="#64b5cd", lw=1, ls=":", label="host peak (offloaded)")
    ax.set_xlabel("tensor operations in one training step")
    ax.set_ylabel("live tensor memory (MiB)")
    ax.set_title("one measured step, by category", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def _draw_run(ax: Any, report: Report) -> None:
    loss, peak = report.curves.get("loss", []), report.curves.get("peak_mib", [])
    if loss:
        ax.plot([p[0] for p in loss], [p[1] for p in loss], color="#4c72b0", label="train loss")
    eval_loss = report.curves.get("eval_loss", [])
    if eval_loss:
        ax.plot([p[0] for p in eval_loss], [p[1] for p in eval_loss], "o--", color="#55a868",
                label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("the run", fontsize=10)
    if peak:
        twin = ax.twinx()
        twin.plot([p[0] for p in peak], [p[1] for p in peak], "s:", color="#c44e52", ms=3,
                  label="measured peak (MiB)")
        twin.set_ylabel("peak memory (MiB)")
        twin.set_ylim(bottom=0)
        twin.legend(fontsize=7, loc="lower left")
    ax.legend(fontsize=7, loc="lower right" if peak else "upper right")
