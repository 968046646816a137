"""Choosing settings: the fastest combination whose predicted peak fits the budget.

- :mod:`~memtrain.plan.planner` — :func:`~memtrain.plan.planner.plan` and its
  :class:`~memtrain.plan.planner.Plan` (``memtrain plan``);
- :mod:`~memtrain.plan.space` — the values each ``auto`` field may take, in memory order;
- :mod:`~memtrain.plan.search` — enumerate, bound, trace the candidates that may win;
- :mod:`~memtrain.plan.costmodel` — seconds of a step from the trace's counts;
- :mod:`~memtrain.plan.view` — the plan as tables, with the reasons;
- :mod:`~memtrain.plan.autofit` — ``training.micro_batch_size: auto``: predicted, then confirmed
  by a real probe step.
"""
