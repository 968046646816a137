"""Every command exits non-zero when its work failed (issue 26, point 1): 1 for a bug (an error
injected into the library function the command calls, or into the optimizer mid-training), 2 for
a user mistake (tests/cli/test_mistakes.py), 130 for Ctrl-C; the error's own message is shown.

The command leaves through ``os._exit`` (memtrain.cli.app._end_without_teardown), so an exception left
to the interpreter would print its traceback and still exit 0: these tests run real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import causal_recipe

DRIVER = Path(__file__).resolve().parents[1] / "fault_driver.py"
ROOT = Path(__file__).resolve().parents[2]

# command line -> the library function it calls (the fault goes there)
COMMANDS = {
    "train": (["train", "quickstart"], "memtrain.run.train:train"),
    "validate": (["validate", "quickstart", "--show"], "memtrain.config:dump_recipe"),
    "recipes": (["recipes"], "memtrain.config:shipped_recipes_dir"),
    "datasets": (["datasets"], "rich.table:Table.add_row"),
    "estimate": (["estimate", "quickstart"], "memtrain.estimator.estimate:estimate"),
    "plan": (["plan", "quickstart", "--budget", "1GiB"], "memtrain.plan.planner:plan"),
    "calibrate": (["calibrate", "--quick"], "memtrain.estimator.calibrate:calibrate"),
    "report": (["report", "runs/x"], "memtrain.memory.report:load_report"),
    "merge": (["merge", "runs/x"], "memtrain.run.inference:merge"),
    "generate": (["generate", "runs/x", "hello"], "memtrain.run.inference:load_run"),
    "predict": (["predict", "runs/x", "lines.jsonl"], "memtrain.run.inference:load_run"),
}


def run_with_fault(target: str, args: list[str], after: int = 0, exception: str = "RuntimeError",
                   cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DRIVER), target, str(after), exception, *args],
                          capture_output=True, text=True, timeout=300, check=False, cwd=cwd)


# CI's long leg: generate and predict (they fail where merge's case does, load_run), estimate and plan
LONG = ("generate", "predict", "estimate", "plan")


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.long) if c in LONG
                                     else c for c in sorted(COMMANDS)])
def test_a_fault_in_any_command_exits_1_with_its_message(command: str) -> None:
    args, target = COMMANDS[command]
    done = run_with_fault(target, args)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "injected fault" in done.stderr and "internal error" in done.stderr, done.stderr[-2000:]


def test_ctrl_c_exits_130() -> None:
    done = run_with_fault("memtrain.config:dump_recipe", ["validate", "quickstart", "--show"],
                          exception="KeyboardInterrupt")
    assert done.returncode == 130, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_fault_in_the_optimizer_mid_training_exits_1(tmp_path: Path, tiny_text_file: Path) -> None:
    """The issue's case: an error in the second optimizer step of a real `memtrain train` run."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(causal_recipe(tmp_path, tiny_text_file, training={"max_steps": 3})))
    done = run_with_fault("torch.optim:AdamW.step", ["train", str(recipe)], after=1)
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "injected fault in torch.optim:AdamW.step (call 2)" in done.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()  # nothing claims a finished run
