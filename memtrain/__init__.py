"""memtrain: fine-tune Hugging Face models under a memory budget.

The recipe flow (``memtrain train``) and the pieces a plain ``transformers.Trainer`` user adds
to their own script are both importable from here.
"""

from memtrain.config import RunConfig, load_recipe
from memtrain.errors import MemtrainError
from memtrain.memory.estimate import Estimate, estimate
from memtrain.patches import apply_patches

__version__ = "0.1.0"

__all__ = ["Estimate", "MemtrainError", "RunConfig", "apply_patches", "estimate", "load_recipe"]
