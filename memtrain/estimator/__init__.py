"""Predicting memory without weights: fake-tensor traces of the real training step.

- :mod:`~memtrain.estimator.estimate` — :func:`~memtrain.estimator.estimate.estimate` and ``sweep``:
  the public entry points (``memtrain estimate``);
- :mod:`~memtrain.estimator.setup` — what to trace for a recipe (architecture, shape, device);
- :mod:`~memtrain.estimator.trace` — trace a step on fake tensors, extrapolate in depth and batch;
- :mod:`~memtrain.estimator.trace_events` — the meter, recording every op while tracing;
- :mod:`~memtrain.estimator.fake` — a ``FakeTensorMode`` real training code runs in, and the model
  built on it;
- :mod:`~memtrain.estimator.pool` — independent traces side by side in forked processes;
- :mod:`~memtrain.estimator.catalog` — architecture configs of popular models, offline;
- :mod:`~memtrain.estimator.calibrate` — this machine's overheads and rates (``memtrain calibrate``);
- :mod:`~memtrain.estimator.real_step` — the recipe's real step, built and measured or timed here;
- :mod:`~memtrain.estimator.trainer_loss` — a user's Trainer (any subclass: TRL's SFT, DPO, ...):
  its own ``training_step`` traced on fake tensors over the longest batch its collator makes.
"""
