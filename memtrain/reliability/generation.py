"""Out-of-memory recovery while an RL trainer generates: fewer prompts per ``generate`` call.

TRL's GRPOTrainer samples the completions of a whole generation batch in one Hugging Face
``generate`` call: every prompt repeated ``num_generations`` times, one row each, left-padded to the
longest prompt. Its KV cache grows with the rows and with the tokens generated, so it runs out of
memory late, when the completions are longest. :class:`GenerationRecovery` wraps the model's
``generate``: on an out-of-memory error it frees what the call held and generates the same rows in
two calls, then four, ..., each a run of whole groups (a prompt's ``num_generations`` completions
are never split across calls), and joins the outputs. The split is kept for the rest of the run.

What stays the same: the prompts, how many completions each gets (the group whose mean reward is
GRPO's baseline), the completions per optimizer step, and the optimizer. What changes is only how
many rows a ``generate`` call holds; sampling draws its random numbers per call, so the
completions are other samples of the same distribution. The outputs of the calls are joined by
padding the shorter ones on the right with the pad token: a call's output is shorter only when
every row in it ended (an end-of-sequence token) before the longest call's, and TRL masks
everything after a completion's first end-of-sequence token.

Not recovered: one group that does not fit (:class:`GroupTooLarge`, naming what to lower), a call
that returns more than token ids (``return_dict_in_generate``), and several processes (their
sharded forward passes gather weights together; one process cannot redo a call alone).
"""

from __future__ import annotations

import itertools
import logging
import types
from typing import Any

import torch
from torch import nn

from memtrain.distributed.together import world
from memtrain.errors import MemtrainError
from memtrain.reliability.layouts import Rows
from memtrain.reliability.oom import free_memory, is_out_of_memory
from memtrain.reliability.replay import log_entry

log = logging.getLogger(__name__)


class GroupTooLarge(torch.OutOfMemoryError, MemtrainError):
    """Out of memory generating one prompt's group of completions: no split can help."""


class GenerationRecovery:
    """Wrap ``model.generate`` so that a call that runs out of memory is redone in smaller calls of
    whole groups of ``group`` rows (see the module docstring).

    Args:
        trainer: the Trainer (for its log and step), whose ``model`` generates.
        group: rows per prompt (``num_generations``).
    """

    def __init__(self, trainer: Any, group: int) -> None:
        self.trainer = trainer
        self.group = max(1, int(group))
        self.parts = 1  # calls each generation batch is split into
        self.events: list[dict[str, int]] = []

    def install(self) -> GenerationRecovery:
        """Route ``trainer.model.generate`` through :meth:`generate` (an instance attribute)."""
        model: nn.Module = self.trainer.model
        if getattr(model.generate, "_memtrain_recovery", None) is not None:
            return model.generate._memtrain_recovery  # type: ignore[no-any-return]
        stock = model.generate

        def generate(_: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self.generate(stock, *args, **kwargs)

        bound = types.MethodType(generate, model)
        bound.__func__._memtrain_recovery = self  # type: ignore[attr-defined]
        model.generate = bound
        return self

    def generate(self, stock: Any, *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return self._in_parts(stock, args, kwargs)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if isinstance(err, GroupTooLarge) or not is_out_of_memory(err) or world()[1] > 1 or args:
                    raise
                message = str(err)
            free_memory()  # outside the except block: the failed call's cache is gone
            self._shrink(kwargs, message)

    def _groups(self, kwargs: dict[str, Any]) -> tuple[int, int]:
        """(rows, whole groups) of a ``generate`` call's ``input_ids``; (rows, 0) where the rows are
        not whole groups (then the call is not split)."""
        ids = kwargs.get("input_ids")
        rows = int(ids.shape[0]) if isinstance(ids, torch.Tensor) else 0
        return rows, (rows // self.group if rows and rows % self.group == 0 else 0)

    def _in_parts(self, stock: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rows, groups = self._groups(kwargs)
        parts = min(self.parts, groups)
        if parts <= 1 or args:
            return stock(*args, **kwargs)
        edges = [self.group * (i * groups // parts) for i in range(parts + 1)]
        batch = Rows(kwargs, rows)  # tensors with a row per completion are cut, the rest shared
        outputs = []
        for start, end in itertools.pairwise(edges):
            out = stock(**batch.piece(start, end))
            if not isinstance(out, torch.Tensor):  # a dict of scores etc.: not joined here
                raise MemtrainError("generation in parts returned more than token ids "
                                    "(`return_dict_in_generate`); it cannot be joined")
            outputs.append(out)
        longest = max(out.shape[1] for out in outputs)
        pad = self._pad_id(kwargs)
        return torch.cat([nn.functional.pad(out, (0, longest - out.shape[1]), value=pad) for out in outputs])

    def _pad_id(self, kwargs: dict[str, Any]) -> int:
        config = kwargs.get("generation_config") or getattr(self.trainer.model, "generation_config", None)
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return 0

    def _shrink(self, kwargs: dict[str, Any], message: str) -> None:
        rows, groups = self._groups(kwargs)
        before = -(-groups // min(self.parts, groups)) if groups else 0
        if before <= 1:
            raise GroupTooLarge(
                f"Out of memory generating the completions of one prompt ({self.group} completions, "
                f"`num_generations`): no smaller generation batch can help. Fix: a lower "
                "`max_completion_length` or `num_generations`, a larger budget, or a smaller model."
                f"\nThe error was: {message}")
        self.parts = min(self.parts * 2, groups)
        after = -(-groups // self.parts)
        step = self.trainer.state.global_step + 1
        log.warning("Out of memory generating %d completions (%d prompts x %d) in optimizer step %d: freed "
                    "memory, generating %d prompts' completions per call (the completions per prompt and "
                    "per step are unchanged). First line of the error: %s", rows, groups, self.group, step,
                    after, message.splitlines()[0] if message else "")
        self.events.append({"step": step, "prompts_before": before, "prompts": after, "group": self.group})
        log_entry(self.trainer, {"memory/recovered_generation_prompts": float(after)})

