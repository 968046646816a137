"""Running: ``memtrain train`` end to end, its processes and machines, and using its output.

- :mod:`~memtrain.run.train` — :func:`~memtrain.run.train.train`: recipe -> saved adapter/model,
  metrics and memory report;
- :mod:`~memtrain.run.launch` — start the processes of a multi-process run, report failures;
- :mod:`~memtrain.run.nodes` — several machines: where this one meets the others;
- :mod:`~memtrain.run.worker` — one training process (``python -m memtrain.run.worker``);
- :mod:`~memtrain.run.inference` — merge, generate and predict on a finished run.
"""
