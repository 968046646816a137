"""Training itself: the Trainer subclass, the one step, and what a step holds, built for real.

- :mod:`~memtrain.trainer.trainer` — :class:`~memtrain.trainer.trainer.MemtrainTrainer` and
  ``TrainingArguments`` from a recipe;
- :mod:`~memtrain.trainer.preference` — ``training.objective: dpo``: TRL's ``DPOTrainer`` behind
  ``MemtrainTrainer``, and its loss for the estimator's step;
- :mod:`~memtrain.trainer.build` — the real model (loaded, patched), the Trainer's optimizer and the
  worst-case example batch: training, estimation and measurement all build here;
- :mod:`~memtrain.trainer.step` — the one optimizer step every estimate, measurement and probe
  runs (and :func:`~memtrain.trainer.step.measure_step`, that step under the meter);
- :mod:`~memtrain.trainer.callbacks` — the memory meter as a Trainer callback;
- :mod:`~memtrain.trainer.optimizer_in_backward` and :mod:`~memtrain.trainer.optimizer_offload` —
  the optimizer step inside backward, and optimizer state on the CPU.
"""
