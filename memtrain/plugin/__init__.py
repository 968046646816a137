"""memtrain inside a user's own ``transformers.Trainer`` script: two lines.

    model, args = memtrain.prepare_for_budget(model, args, budget="24GiB")
    trainer = memtrain.attach(Trainer(model=model, args=args, ...))

- :mod:`~memtrain.plugin.prepare` — ``prepare_for_budget``, ``attach`` and the
  ``MemoryBudgetCallback``;
- :mod:`~memtrain.plugin.checks` — their arguments checked first: a bad one named, with its value
  and the fix, before anything is traced;
- :mod:`~memtrain.plugin.describe` — the user's model and arguments as a recipe, and the
  decision (:class:`~memtrain.plugin.describe.BudgetPlan`) as the user sees it;
- :mod:`~memtrain.plugin.options` — the user's own Trainer options, each modelled or said not to be;
- :mod:`~memtrain.plugin.apply` — the decision applied: patches on the model, new arguments;
- :mod:`~memtrain.plugin.trainer_step` — what ``attach`` learns from the Trainer: its data read
  and the plan made for it, its own step traced (TRL's losses, DPO's reference forward), the
  micro-batch refitted, or "not modelled".

Importing the plugin imports transformers, and with it torchao and bitsandbytes, whose compiled
extensions for other machines fail to load on this one and say so in five harmless lines (two
"Failed to load ...torchao/_C_...so", two ``torch.utils._pytree`` deprecation warnings torchao's
enums trigger, one bitsandbytes "Failed to load CPU gemm_4bit_forward from kernels-community"; on
torch 2.10, torchao 0.18's "Skipping import of cpp extensions": memtrain uses only its pure-Python
CPU-offload optimizer; offline, kernels' "Skipping publisher trust check" for that kernel).
:func:`_quiet_imports` drops exactly those records while the import runs; every other message,
and the same messages later, still reach the user's logging.
"""

import contextlib
import logging
from collections.abc import Iterator

# logger -> the start of the messages dropped from it during the import
HARMLESS = {"torchao": ("Failed to load ", "Skipping import of cpp extensions"),
            "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
            "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
            # kernels 0.19 (which transformers 5.25 requires) with huggingface_hub 2.4, offline
            "kernels._internals.hf_hub": ("Skipping publisher trust check for ",)}


class _Harmless(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    filters = [(logging.getLogger(name), _Harmless(starts)) for name, starts in HARMLESS.items()]
    for logger, found in filters:
        logger.addFilter(found)
    try:
        yield
    finally:
        for logger, found in filters:
            logger.removeFilter(found)


with _quiet_imports():
    from memtrain.plugin.prepare import MemoryBudgetCallback, attach, prepare_for_budget

__all__ = ["MemoryBudgetCallback", "attach", "prepare_for_budget"]
