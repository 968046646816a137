"""Several processes: what the recipe asks for, FSDP2 sharding, and decisions taken together.

- :mod:`~memtrain.distributed.sharding` — the ``distributed`` section as plain decisions
  (is this run sharded? which storage dtype for 4-bit weights?);
- :mod:`~memtrain.distributed.fsdp` — shard a model with FSDP2, the accelerate plugin, a fake
  process group for estimating one process;
- :mod:`~memtrain.distributed.together` — one all-reduce per decision that every process must
  take alike (no-ops in one process).

Starting processes and machines is :mod:`memtrain.run.launch` and :mod:`memtrain.run.nodes`.
"""
