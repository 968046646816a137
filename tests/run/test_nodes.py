"""Several machines: the `distributed` fields a cluster needs, read from the recipe or the
launcher's environment, their checks, and the launch torch's agent gets from them.

The real two-machine run (two launcher invocations on this machine) is in test_distributed.py,
beside the one-machine runs it is compared with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import causal_recipe, merge

from memtrain.config import RecipeError, load_recipe
from memtrain.errors import MemtrainError
from memtrain.run import launch, nodes

CLUSTER = {"processes": 4, "nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29511}


def cfg(tmp_path: Path, **distributed: object):
    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "a b c"}\n', encoding="utf-8")
    return load_recipe(causal_recipe(tmp_path, data, distributed=distributed))


def problems(tmp_path: Path, **distributed: object) -> str:
    with pytest.raises(RecipeError) as err:
        cfg(tmp_path, **distributed)
    return str(err.value)


def test_processes_count_every_machine_and_the_launch_says_so(tmp_path: Path) -> None:
    m = nodes.machines(cfg(tmp_path, **CLUSTER).distributed, {})
    assert m == nodes.Machines(nodes=2, node_rank=1, per_node=2, endpoint="10.0.0.1:29511")
    config = launch._launch_config(m)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "10.0.0.1:29511")
    assert config.rdzv_configs["is_host"] is False  # machine 0 hosts the rendezvous
    host = launch._launch_config(nodes.machines(cfg(tmp_path, **{**CLUSTER, "node_rank": 0}).distributed))
    assert host.rdzv_configs["is_host"] is True and host.run_id == config.run_id  # one run
    one = nodes.machines(cfg(tmp_path, processes=2).distributed)
    assert (one.nodes, one.per_node, one.endpoint) == (1, 2, "localhost:0")  # standalone, any port


def test_env_fields_come_from_the_launchers_environment(tmp_path: Path) -> None:
    env_cfg = cfg(tmp_path, processes=4, nodes=2, node_rank="env", master_addr="env", master_port="env")
    slurm = {"SLURM_NODEID": "1", "MASTER_ADDR": "node-a", "MASTER_PORT": "29600"}
    assert nodes.machines(env_cfg.distributed, slurm).endpoint == "node-a:29600"
    assert nodes.machines(env_cfg.distributed, slurm).node_rank == 1
    torchrun_style = {**slurm, "NODE_RANK": "0"}  # NODE_RANK wins over SLURM_NODEID
    assert nodes.machines(env_cfg.distributed, torchrun_style).hosts_rendezvous
    ipv6 = nodes.machines(env_cfg.distributed, {**slurm, "MASTER_ADDR": "fd00::1"})
    assert ipv6.endpoint == "[fd00::1]:29600"


@pytest.mark.parametrize(("environ", "expected"), [
    ({"MASTER_ADDR": "a", "MASTER_PORT": "1"}, "`distributed.node_rank`: `env`, but NODE_RANK and "
                                               "SLURM_NODEID are not set"),
    ({"NODE_RANK": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "`distributed.node_rank`: '2' (from NODE_RANK) is not between 0 and `distributed.nodes` - 1 = 1"),
    ({"NODE_RANK": "x", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "`distributed.node_rank`: 'x' (from "
                                                                 "NODE_RANK) is not a whole number"),
    ({"NODE_RANK": "0", "MASTER_PORT": "1"}, "`distributed.master_addr`: `env`, but MASTER_ADDR is not set"),
    ({"NODE_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "70000"},
     "`distributed.master_port`: '70000' (from MASTER_PORT) is not a TCP port"),
])
def test_env_fields_missing_or_bad_name_the_field_and_the_variable(tmp_path: Path, environ: dict,
                                                                   expected: str) -> None:
    env_cfg = cfg(tmp_path, processes=4, nodes=2, node_rank="env", master_addr="env", master_port="env")
    with pytest.raises(MemtrainError, match="Fix:") as err:
        nodes.machines(env_cfg.distributed, environ)
    assert expected in str(err.value)


def test_recipe_checks_name_each_field(tmp_path: Path) -> None:
    text = problems(tmp_path, processes=3, nodes=2)
    assert "`distributed.processes`: counts the processes of all 2 machines" in text
    assert "`distributed.node_rank`: is needed with `distributed.nodes: 2`" in text
    assert "`distributed.master_addr`: is needed with `distributed.nodes: 2`" in text
    assert "must be between 0 and `distributed.nodes` - 1 = 1, got 2" in problems(
        tmp_path, **{**CLUSTER, "node_rank": 2})
    assert "`distributed.master_port`: is not a TCP port, got 0" in problems(
        tmp_path, **{**CLUSTER, "master_port": 0})


def test_bad_node_rank_exits_2_without_a_traceback(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from memtrain.cli.app import app

    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "a b c"}\n', encoding="utf-8")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(causal_recipe(tmp_path, data)), encoding="utf-8")
    for overrides, field in ((["distributed.nodes=2", "distributed.processes=2",
                               "distributed.master_addr=127.0.0.1", "distributed.node_rank=2"],
                              "`distributed.node_rank`"),
                             (["distributed.nodes=2", "distributed.processes=2", "distributed.node_rank=1"],
                              "`distributed.master_addr`")):
        result = CliRunner().invoke(app, ["train", str(recipe), *overrides])
        shown = " ".join(result.output.split())
        assert result.exit_code == 2, shown
        assert field in shown and "Fix:" in shown and "Traceback" not in shown


def test_effective_batch_is_over_every_machines_processes(tmp_path: Path) -> None:
    from memtrain.config.batch import resolve_batch

    run = cfg(tmp_path, **CLUSTER)
    base = causal_recipe(tmp_path, tmp_path / "t.jsonl", distributed=CLUSTER)
    fixed = load_recipe(merge(base, {"training": {"effective_batch_size": 32, "micro_batch_size": 4,
                                                  "gradient_accumulation": None}}))
    assert resolve_batch(fixed.training, fixed.distributed.processes).accumulation == 2  # 32 = 4 x 2 x 4
    assert run.distributed.processes == 4
    with pytest.raises(RecipeError, match=r"multiple of micro_batch_size × processes = 16"):
        load_recipe(merge(base, {"training": {"effective_batch_size": 24, "micro_batch_size": 4,
                                              "gradient_accumulation": None}}))


def test_the_launch_config_fits_torch_versions_without_a_shutdown_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's LaunchConfig has no `shutdown_timeout` (a TypeError failed every multi-process
    run there); where it has one, the processes get 300 s to save on a signal."""
    import dataclasses

    import torch.distributed.launcher.api as api

    m = nodes.machines(cfg(tmp_path, processes=2).distributed)
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(api.LaunchConfig)}:
        assert launch._launch_config(m).shutdown_timeout == launch.SHUTDOWN_TIMEOUT_S
    kept = [(f.name, f.type, f) for f in dataclasses.fields(api.LaunchConfig) if f.name != "shutdown_timeout"]
    older = dataclasses.make_dataclass("LaunchConfig", kept)
    monkeypatch.setattr(api, "LaunchConfig", older)
    config = launch._launch_config(m)
    assert isinstance(config, older) and config.nproc_per_node == 2
