"""Several machines: where this one meets the others, from the recipe or the launcher's environment.

A run over ``distributed.nodes`` machines is started once on each machine (by hand, ``srun``, ``pdsh``,
a Kubernetes job) with the same recipe. Each memtrain starts torch's elastic agent for its
``processes / nodes`` processes (:mod:`memtrain.run.launch`), and the agents meet at
``master_addr:master_port`` through torch's c10d rendezvous, which machine 0
(``node_rank: 0``) hosts: no rendezvous of memtrain's own. Process ranks are numbered by that
rendezvous (a machine's processes get consecutive ranks), so ``node_rank`` only says which
machine hosts it.

``distributed.processes`` counts the processes of every machine (the world size, as accelerate's
``num_processes``): the batch arithmetic (effective = micro × accumulation × processes), the
sharding and the per-process estimate all read it as the world size, on one machine or several.

A field set to ``env`` is read from the environment a cluster launcher leaves (torchrun-style
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; SLURM's ``SLURM_NODEID``), when memtrain starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from memtrain.config import DistributedConfig
from memtrain.errors import MemtrainError

# Where `env` looks, first match wins.
ENV_SOURCES: dict[str, tuple[str, ...]] = {
    "node_rank": ("NODE_RANK", "SLURM_NODEID"),
    "master_addr": ("MASTER_ADDR",),
    "master_port": ("MASTER_PORT",),
}


@dataclass(frozen=True)
class Machines:
    """The machines of a run, as this one sees them."""

    nodes: int
    node_rank: int
    per_node: int  # processes on each machine
    endpoint: str  # host:port of the rendezvous ("localhost:0" on one machine: any free port)

    @property
    def hosts_rendezvous(self) -> bool:
        return self.node_rank == 0


def machines(d: DistributedConfig, environ: Mapping[str, str] | None = None) -> Machines:
    """The machines ``d`` describes, with ``env`` fields read from ``environ`` (default: os.environ).

    Raises:
        MemtrainError: an ``env`` field whose variables are unset or not valid values.
    """
    if d.nodes == 1:
        return Machines(1, 0, d.processes, "localhost:0")
    environ = os.environ if environ is None else environ
    rank = _number("node_rank", d.node_rank, environ)
    if not 0 <= rank < d.nodes:
        raise MemtrainError(
            f"`distributed.node_rank`: {_shown('node_rank', d.node_rank, environ)} is not between 0 and "
            f"`distributed.nodes` - 1 = {d.nodes - 1}. Fix: number the machines 0 to {d.nodes - 1}, or "
            "set `distributed.nodes` to the number of machines the launcher started.")
    port = _number("master_port", d.master_port, environ)
    if not 0 < port < 65536:
        raise MemtrainError(f"`distributed.master_port`: {_shown('master_port', d.master_port, environ)} "
                            "is not a TCP port. Fix: a free port between 1024 and 65535.")
    addr = _value("master_addr", d.master_addr, environ)
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr  # IPv6
    return Machines(d.nodes, rank, d.processes // d.nodes, f"{host}:{port}")


def _value(field: str, value: object, environ: Mapping[str, str]) -> str:
    """The field's value, or for ``env`` the first of its variables that is set."""
    if value is None:  # the schema requires it with several nodes; a Python caller may skip that
        raise MemtrainError(f"`distributed.{field}` is needed with several nodes. Fix: set it, or "
                            f"`env` to read {' / '.join(ENV_SOURCES[field])}.")
    if value != "env":
        return str(value)
    for name in ENV_SOURCES[field]:
        if environ.get(name, "").strip():
            return environ[name].strip()
    raise MemtrainError(
        f"`distributed.{field}`: `env`, but {' and '.join(ENV_SOURCES[field])} "
        f"{'are' if len(ENV_SOURCES[field]) > 1 else 'is'} not set. Fix: start memtrain from the "
        f"launcher that sets {ENV_SOURCES[field][0]} (or export it), or give `distributed.{field}` "
        "a value.")


def _number(field: str, value: object, environ: Mapping[str, str]) -> int:
    text = _value(field, value, environ)
    try:
        return int(text)
    except ValueError:
        raise MemtrainError(f"`distributed.{field}`: {_shown(field, value, environ)} is not a whole "
                            "number. Fix: set it (or the variable) to one.") from None


def _shown(field: str, value: object, environ: Mapping[str, str]) -> str:
    """How a value is named in a message: the variable it came from, for ``env``."""
    if value != "env":
        return repr(value)
    name = next(n for n in ENV_SOURCES[field] if environ.get(n, "").strip())
    return f"{environ[name].strip()!r} (from {name})"
