"""memtrain: fine-tune Hugging Face models under a memory budget.

The recipe flow (``memtrain train``) and the pieces a plain ``transformers.Trainer`` user adds
to their own script are both importable from here.
"""

from typing import TYPE_CHECKING, Any

from memtrain.errors import MemtrainError

if TYPE_CHECKING:
    from memtrain.config import RunConfig, load_recipe
    from memtrain.estimator.estimate import Estimate, estimate
    from memtrain.patches import apply_patches
    from memtrain.plugin.prepare import MemoryBudgetCallback, attach, prepare_for_budget

__version__ = "0.1.0"

__all__ = ["Estimate", "MemoryBudgetCallback", "MemtrainError", "RunConfig", "apply_patches", "attach",
           "estimate", "load_recipe", "prepare_for_budget"]


def __getattr__(name: str) -> Any:
    # The estimator pulls in transformers, peft and bitsandbytes, the patches torch (seconds to
    # import): load them on first use, so that `import memtrain` and quick CLI commands stay fast.
    if name in ("RunConfig", "load_recipe"):  # pydantic and the schema: not needed for `--help`
        from memtrain import config

        return getattr(config, name)
    if name == "apply_patches":
        from memtrain.patches import apply_patches

        return apply_patches
    if name in ("Estimate", "estimate"):
        from memtrain.estimator import estimate as module

        return getattr(module, name)
    if name in ("MemoryBudgetCallback", "attach", "prepare_for_budget"):  # the plain-Trainer plugin
        from memtrain.plugin import prepare as plugin

        return getattr(plugin, name)
    raise AttributeError(f"module 'memtrain' has no attribute {name!r}")
