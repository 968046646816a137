"""memtrain inside a user's own ``transformers.Trainer`` script: two lines.

    model, args = memtrain.prepare_for_budget(model, args, budget="24GiB")
    trainer = memtrain.attach(Trainer(model=model, args=args, ...))

- :mod:`~memtrain.plugin.prepare` — ``prepare_for_budget``, ``attach`` and the
  ``MemoryBudgetCallback``;
- :mod:`~memtrain.plugin.describe` — the user's model and arguments as a recipe, and the
  decision (:class:`~memtrain.plugin.describe.BudgetPlan`) as the user sees it;
- :mod:`~memtrain.plugin.trainer_step` — what ``attach`` learns from the Trainer: its own step
  traced (TRL's losses, DPO's reference forward), the micro-batch refitted, or "not modelled".
"""

from memtrain.plugin.prepare import MemoryBudgetCallback, attach, prepare_for_budget

__all__ = ["MemoryBudgetCallback", "attach", "prepare_for_budget"]
