"""A training process with a budget of its own: ``python -m rank_budget_worker RECIPE EXCHANGE_DIR``.

Test helper for several processes where only one runs short of memory (one GPU shared with another
job, say). It replaces ``memtrain.run.worker`` (``memtrain.run.launch.WORKER_MODULE``, set in the launching
test) and, in the ranks named by ``MEMTRAIN_TEST_RANK_BUDGETS`` (JSON:
``{"1": {"probe": "60MiB", "train": "40MiB"}}``), gives the auto-fit probe and the simulated budget
of training those limits instead of the recipe's ``memory.simulate_budget``. Everything else is
``memtrain.run.worker``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _own_budgets() -> None:
    import memtrain.plan.autofit
    from memtrain.reliability.budget import SimulatedBudgetCallback
    from memtrain.units import parse_size

    limits = json.loads(os.environ.get("MEMTRAIN_TEST_RANK_BUDGETS", "{}")).get(os.environ["RANK"])
    if not limits:
        return
    if "probe" in limits:
        memtrain.plan.autofit.budget_limit = lambda cfg: parse_size(limits["probe"])
    if "train" in limits:
        init = SimulatedBudgetCallback.__init__

        def own_limit(self: Any, limit: Any) -> None:
            init(self, limits["train"])

        SimulatedBudgetCallback.__init__ = own_limit  # type: ignore[method-assign]


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from memtrain.run.worker import main

    _own_budgets()
    sys.exit(record(main)(sys.argv[1:]))
