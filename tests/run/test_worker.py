"""One training process of a multi-process run (memtrain.run.worker), without launching the others.

A recipe mistake found inside a training process must reach the user as a mistake: the process
exits 2 and leaves the message in torch's error file, which the launcher turns into the command's
message and exit status. The two-process run in tests/distributed/test_distributed.py checks the
same through the real launcher, but slowly; this starts one worker process as the launcher would
(``python -m memtrain.run.worker RECIPE EXCHANGE_DIR`` with torch's environment) and hands what it
left to the launcher's own reading of a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import causal_recipe
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from memtrain.run import launch


def test_a_recipe_mistake_in_a_training_process_exits_2_and_names_the_field(tmp_path: Path) -> None:
    data = tmp_path / "no_text.jsonl"  # the `text` column is missing: found when the worker reads it
    data.write_text("\n".join(json.dumps({"body": f"row {i}"}) for i in range(8)), encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(causal_recipe(tmp_path, data, distributed={"processes": 2})),
                      encoding="utf-8")
    exchange = tmp_path / "exchange"
    exchange.mkdir()
    error_file = tmp_path / "error.json"
    # process 1 of 2, as torch's agent starts it; WORLD_SIZE=2 so it trains instead of launching,
    # and the mistake is found before it would wait for process 0
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_ERROR_FILE": str(error_file)}
    done = subprocess.run([sys.executable, "-m", launch.WORKER_MODULE, str(recipe), str(exchange)],
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    message = json.loads(error_file.read_text(encoding="utf-8"))["message"]
    assert isinstance(message, str) and "`data.text_column`: is not a column of the data" in message
    assert not list(exchange.glob("rank*.pkl"))  # no result left for the launcher

    # what the launcher makes of it: the agent stopped process 0 (SIGTERM) when process 1 exited
    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file=str(tmp_path / "none.json"))
    failed = ProcessFailure(local_rank=1, pid=101, exitcode=done.returncode, error_file=str(error_file))
    err = launch._launch_error(ChildFailedError("worker", {0: stopped, 1: failed}), 2)
    assert err.exit_code == 2
    assert str(err) == f"{message} (in training process 1 of 2)"
