"""Measuring memory: what a step really holds, by category and phase. Nothing here predicts.

- :mod:`~memtrain.memory.meter` — :class:`~memtrain.memory.meter.MemoryMeter`, peak live tensor
  bytes by category (parameters, gradients, optimizer state, activations, temporaries, host) and
  phase; :func:`~memtrain.memory.meter.mark_host` tags tensors moved to host memory;
- :mod:`~memtrain.memory.trackers` — the torch ``MemTracker``/``ModTracker`` layer under the meter;
- :mod:`~memtrain.memory.quantized` — the bytes bitsandbytes' quantization state takes (and the
  same state built on fake tensors, for the estimator);
- :mod:`~memtrain.memory.report` — ``memory_report.json``/``.png``: measured vs predicted;
- :mod:`~memtrain.memory.hostmem` — keep freed CPU memory in the process (glibc ``mallopt``).

Stands before :mod:`memtrain.patches` in the run order because patches tag the tensors they move
to the host with :func:`~memtrain.memory.meter.mark_host`.
"""
