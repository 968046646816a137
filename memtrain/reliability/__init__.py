"""Losing no work: checkpoints, the run folder, out-of-memory recovery, signals, NaN steps.

- :mod:`~memtrain.reliability.checkpoints` — the one checkpoint writer (staged, synced, verified,
  renamed into place) and reader;
- :mod:`~memtrain.reliability.rundir` — the output folder: what may be written, what to resume;
- :mod:`~memtrain.reliability.budget` — budgets: parse, free device memory, a simulated budget on
  CPU (out-of-memory errors on purpose, for tests and benchmarks);
- :mod:`~memtrain.reliability.recovery` — out-of-memory in training: halve the micro-batch, redo
  the same step with the same effective batch;
- :mod:`~memtrain.reliability.layouts` — where a batch may be cut (rows, preference pairs, packed
  sequences) and which batches must not be;
- :mod:`~memtrain.reliability.replay` — what a replayed step must not do twice (metric side
  effects), and the mid-step log entry;
- :mod:`~memtrain.reliability.eval_recovery` — out-of-memory in evaluation: split the batch;
- :mod:`~memtrain.reliability.guards` — SIGINT/SIGTERM stop at a step boundary, NaN-step guard.
"""
