"""How a collated batch splits into independent pieces, for out-of-memory recovery.

Recovery (:mod:`memtrain.reliability.recovery`, :mod:`memtrain.reliability.eval_recovery`) may cut
a batch only where nothing couples its parts: the pieces' losses, weighted, must add up to the
batch's loss, and every tensor of a piece must describe the same examples. Which cut that is
depends on how the batch was laid out, so an ordered list of small detectors (:data:`DETECTORS`,
first match wins) names the layout of each batch:

1. :func:`coupled_loss`: TRL trainers whose loss couples the examples of a micro-batch (KTO's KL
   baseline, DPO's ``aot``/``aot_unpaired``/``sft`` losses, ORPO's and CPO's NLL term, a token mean
   over the whole micro-batch): :class:`Unsplittable`, with the reason.
2. :func:`stacked_pairs`: TRL's DPO and reward collators stack each batch as ``[chosen; rejected]``
   (2B rows, pair i is rows i and B+i) with per-pair extras (``ref_chosen_logps``,
   ``ref_rejected_logps``, ``margin``: B rows): :class:`Pairs` keeps each pair in one piece and
   splits the extras with their pairs.
3. :func:`packed_row`: one row holding several sequences (padding-free packing: ``position_ids``
   restarting at 0, TRL's ``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/``max_length_k``,
   ``seq_idx``): :class:`Packed` cuts at sequence boundaries and rebuilds those keys per piece.
4. :func:`generated_completions`: TRL's GRPO micro-batch as its trainer prepared it (prompts and
   their completions, one per row, with the advantages and log-probabilities generation computed):
   :class:`Completions`, whose pieces carry their share of the loss as the loss type averages it.
5. :func:`rows`: everything else: :class:`Rows`, one example per row.

A tensor that does not follow the layout (a first dimension that is neither the rows nor, for
pairs, the pairs) makes the batch :class:`Unsplittable` naming it, rather than being copied into
every piece. Each layout counts the batch in the user's units (``unit``): examples, preference
pairs, packed sequences; recovery's logs and messages use them.

Why here and not in TRL: TRL cuts nothing (it has no recovery), and accelerate's
``find_executable_batch_size`` restarts training with a smaller batch instead of redoing a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memtrain._compat.transformers_trainer import loss_shifts_labels
from memtrain._compat.trl import is_grpo, is_trl

Batch = dict[str, Any]


class Layout:
    """A batch's layout: how many ``unit``s it holds and how it splits into pieces of whole units."""

    unit = "example"
    refusal: str | None = None  # set when the batch must not be split (why)

    def __init__(self, inputs: Batch, count: int) -> None:
        self.inputs = inputs
        self.count = count

    def bounds(self, parts: int) -> list[tuple[int, int]]:
        """Unit ranges ``[start, end)`` of ``parts`` pieces (at most one per unit; sizes differ by at
        most one)."""
        count = min(parts, self.count)
        edges = [i * self.count // count for i in range(count + 1)]
        return [(edges[i], edges[i + 1]) for i in range(count)]

    def split(self, parts: int) -> list[Batch]:
        """The batch in ``parts`` pieces (fewer when it holds fewer units)."""
        return [self.piece(start, end) for start, end in self.bounds(parts)]

    def piece(self, start: int, end: int) -> Batch:
        raise NotImplementedError

    def join(self, outputs: list[torch.Tensor], parts: int) -> torch.Tensor:
        """Put the pieces' outputs (logits, labels) back in the batch's order."""
        return torch.cat(outputs)

    def share(self, piece: Batch) -> float | None:
        """The weight of ``piece``'s loss in the batch's, where the layout knows how its trainer's loss
        averages (None: recovery finds out, :meth:`MicroBatchRecovery._detect_mean_loss`)."""
        return None


class Rows(Layout):
    """One example per row: tensors whose first dimension is the rows are cut, the rest shared."""

    def piece(self, start: int, end: int) -> Batch:
        return {key: value[start:end] if _along(value, self.count) else value
                for key, value in self.inputs.items()}


class Pairs(Layout):
    """``[chosen; rejected]`` stacked along the rows (TRL's preference collators): pair i is rows i
    and ``count + i``; tensors with one row per pair are cut by pairs."""

    unit = "preference pair"

    def piece(self, start: int, end: int) -> Batch:
        out: Batch = {}
        for key, value in self.inputs.items():
            if _along(value, 2 * self.count):
                out[key] = torch.cat([value[start:end], value[self.count + start:self.count + end]])
            elif _along(value, self.count):
                out[key] = value[start:end]
            else:
                out[key] = value
        return out

    def join(self, outputs: list[torch.Tensor], parts: int) -> torch.Tensor:
        sizes = [end - start for start, end in self.bounds(parts)]
        if all(out.shape[0] == 2 * size for out, size in zip(outputs, sizes, strict=True)):
            chosen = [out[:size] for out, size in zip(outputs, sizes, strict=True)]
            rejected = [out[size:] for out, size in zip(outputs, sizes, strict=True)]
            return torch.cat(chosen + rejected)
        return torch.cat(outputs)


_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
_LONGEST_KEYS = ("max_length_q", "max_length_k")


class Packed(Layout):
    """One row of several sequences: cut at sequence starts; boundary keys rebuilt per piece."""

    unit = "packed sequence"

    def __init__(self, inputs: Batch, starts: list[int], tokens: int) -> None:
        super().__init__(inputs, len(starts))
        self.edges = [*starts, tokens]  # token offset of each sequence start, then the row's length
        self.tokens = tokens

    def piece(self, start: int, end: int) -> Batch:
        first, last = self.edges[start], self.edges[end]
        out: Batch = {}
        for key, value in self.inputs.items():
            if key in _BOUNDARY_KEYS:
                out[key] = value[start:end + 1] - value[start]
            elif key in _LONGEST_KEYS:
                out[key] = max(b - a for a, b in zip(self.edges[start:end], self.edges[start + 1:end + 1],
                                                     strict=True))
            elif _along_tokens(value, self.tokens):
                cut = value[:, first:last]
                out[key] = cut - cut[:, :1] if key == "seq_idx" else cut
            else:
                out[key] = value
        return out

    def join(self, outputs: list[torch.Tensor], parts: int) -> torch.Tensor:
        if all(out.dim() >= 2 and out.shape[0] == 1 for out in outputs):
            return torch.cat(outputs, dim=1)
        return torch.cat(outputs)


class Completions(Rows):
    """TRL's GRPO micro-batch after generation: one completion (and its prompt) per row.

    GRPO normalises rewards within each prompt's group of completions when it generates them (TRL's
    ``_generate_and_score_completions``), before the generation batch is shuffled and cut into
    micro-batches: each row carries its advantage, and its loss depends on no other row. What differs
    between loss types is how a micro-batch's per-token losses are averaged (TRL 1.16's
    ``_compute_loss``): a mean of per-completion means (``grpo``, ``sapo``, ``luspo``) or a sum over
    rows times a fixed length (``dr_grpo``) weighs a piece by its rows; a mean over the micro-batch's
    completion tokens (``bnpo``) by its tokens; a sum divided by the whole generation batch's tokens
    (``dapo``, ``cispo``, ``vespo``) needs no weight.
    """

    unit = "completion"

    def __init__(self, inputs: Batch, count: int, average: str) -> None:
        super().__init__(inputs, count)
        self.average = average  # "rows", "tokens" or "sum"

    def share(self, piece: Batch) -> float:
        if self.average == "sum":
            return 1.0
        if self.average == "rows":
            return _rows(piece) / self.count
        whole = int(_tokens(self.inputs))
        return _tokens(piece) / whole if whole else 1.0 / self.count


# How each TRL GRPO loss type averages a micro-batch (see Completions)
GRPO_AVERAGES = {"grpo": "rows", "sapo": "rows", "luspo": "rows", "dr_grpo": "rows", "bnpo": "tokens",
                 "dapo": "sum", "cispo": "sum", "vespo": "sum"}


class Unsplittable(Layout):
    """A batch recovery must not cut; ``refusal`` says why."""

    def __init__(self, inputs: Batch, count: int, reason: str, unit: str = "example") -> None:
        super().__init__(inputs, count)
        self.refusal = reason
        self.unit = unit

    def piece(self, start: int, end: int) -> Batch:
        raise RuntimeError(f"this batch cannot be split: {self.refusal}")


# ------------------------------------------------------------------------------- the detectors

Detector = Callable[[Any, Batch], Layout | None]


def coupled_loss(trainer: Any, inputs: Batch) -> Layout | None:
    """TRL trainers whose loss couples the examples of a micro-batch: pieces would change it."""
    reason = None
    cpo_nll = is_trl(trainer, "CPOTrainer") and bool(getattr(trainer, "cpo_alpha", 0))
    nll = is_trl(trainer, "ORPOTrainer") or cpo_nll
    if is_trl(trainer, "KTOTrainer") and getattr(trainer, "calculate_KL", False):
        reason = ("its loss compares every example with a KL baseline estimated over the whole micro-batch "
                  "(`loss_type='kto'`), so each piece would train against another baseline")
    elif is_trl(trainer, "DPOTrainer"):
        coupled = sorted(set(_loss_types(trainer)) & {"aot", "aot_unpaired", "sft"})
        if coupled:
            reason = (f"its loss types {coupled} are not a mean over independent pairs ('aot' sorts the "
                      "log-ratios across the micro-batch, 'sft' averages over all its chosen tokens)")
    elif nll:
        reason = ("its NLL term is a mean over every chosen token of the micro-batch, so pieces of different "
                  "lengths would be weighted differently")
    if reason is None:
        return None
    rows = _rows(inputs)
    paired = is_trl(trainer, "DPOTrainer") and rows % 2 == 0
    return Unsplittable(inputs, rows // 2 if paired else rows, reason,
                        "preference pair" if paired else "example")


def stacked_pairs(trainer: Any, inputs: Batch) -> Layout | None:
    """TRL's DPO and reward collators: ``input_ids`` holds every chosen sequence, then every rejected one."""
    if not (is_trl(trainer, "DPOTrainer") or is_trl(trainer, "RewardTrainer")):
        return None
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.shape[0] % 2:
        return None  # another collator (separate chosen_/rejected_ keys split by rows)
    pairs = ids.shape[0] // 2
    stray = _stray(inputs, (2 * pairs, pairs))
    if stray:
        return Unsplittable(inputs, pairs, f"`{stray}` has {inputs[stray].shape[0]} rows, neither one per "
                            f"sequence ({2 * pairs}) nor one per pair ({pairs})", Pairs.unit)
    return Pairs(inputs, pairs)


def packed_row(trainer: Any, inputs: Batch) -> Layout | None:
    """One row holding several sequences, told apart by ``cu_seq_lens_q`` or restarting ``position_ids``."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        return None
    tokens = int(ids.shape[1])
    bounds = inputs.get("cu_seq_lens_q")
    positions = inputs.get("position_ids")
    if isinstance(bounds, torch.Tensor):
        starts = [int(b) for b in bounds[:-1]]
    elif isinstance(positions, torch.Tensor) and positions.shape[-1] == tokens:
        starts = [int(i) for i in (positions.reshape(-1, tokens)[0] == 0).nonzero().flatten()]
    else:
        return None
    if len(starts) < 2:
        return None  # one sequence: a row like any other
    if starts[0] != 0:
        return Unsplittable(inputs, len(starts), "its first sequence does not start at token 0", Packed.unit)
    stray = next((key for key, value in inputs.items() if isinstance(value, torch.Tensor) and value.dim() > 0
                  and key not in _BOUNDARY_KEYS and not _along_tokens(value, tokens)), None)
    if stray:
        shape = tuple(inputs[stray].shape)
        return Unsplittable(inputs, len(starts), f"`{stray}` (shape {shape}) does not run "
                            f"along the packed row's {tokens} tokens", Packed.unit)
    return Packed(inputs, starts, tokens)


def generated_completions(trainer: Any, inputs: Batch) -> Layout | None:
    """TRL's GRPOTrainer, on the micro-batch its ``_prepare_inputs`` made (``completion_ids``)."""
    if not (is_grpo(trainer) and isinstance(inputs.get("completion_ids"), torch.Tensor)):
        return None
    count = int(inputs["completion_ids"].shape[0])
    args = getattr(trainer, "args", None)
    loss_type = str(getattr(args, "loss_type", ""))
    reason = None
    if loss_type not in GRPO_AVERAGES:
        reason = f"its loss type {loss_type!r} is not one whose micro-batch average is known here"
    elif float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:
        reason = ("`top_entropy_quantile` < 1 keeps the highest-entropy tokens of the whole micro-batch, "
                  "so a piece would keep others")
    elif float(getattr(args, "entropy_coef", 0.0) or 0.0) or getattr(args, "use_adaptive_entropy", False):
        reason = "its entropy bonus is a mean over every completion token of the micro-batch"
    listed = next((key for key, value in inputs.items() if isinstance(value, (list, tuple))), None)
    stray = _stray(inputs, (count,))
    if reason is None and listed:  # e.g. images per completion: which piece each belongs to is not known here
        reason = f"`{listed}` is a list, not a tensor with one row per completion"
    elif reason is None and stray:
        reason = (f"`{stray}` has {inputs[stray].shape[0]} rows where the micro-batch has {count} "
                  "completions")
    if reason is not None:
        return Unsplittable(inputs, count, reason, Completions.unit)
    return Completions(inputs, count, GRPO_AVERAGES[loss_type])


def rows(trainer: Any, inputs: Batch) -> Layout:
    """One example per row (the Trainer's default collators, padded or not)."""
    count = _rows(inputs)
    stray = _stray(inputs, (count,))
    if stray:
        return Unsplittable(inputs, count, f"`{stray}` has {inputs[stray].shape[0]} rows where the batch has "
                            f"{count}, so which example each belongs to is unknown")
    return Rows(inputs, count)


DETECTORS: tuple[Detector, ...] = (coupled_loss, stacked_pairs, packed_row, generated_completions, rows)


def layout_of(trainer: Any, inputs: Batch) -> Layout:
    """The layout of a collated batch: the first detector that recognises it."""
    for detect in DETECTORS:
        found = detect(trainer, inputs)
        if found is not None:
            return found
    raise AssertionError("unreachable: `rows` recognises every batch")


# ---------------------------------------------------------------------------------- helpers


def batch_rows(inputs: Batch) -> int:
    """Rows of a collated batch (the first dimension of ``input_ids``, else of the first tensor)."""
    return _rows(inputs)


def count_items(trainer: Any, inputs: Batch, layout: Layout | None = None) -> int:
    """What a mean loss averages over, counted as the Trainer counts ``num_items_in_batch``.

    Labels other than -100 (from position 1 on for causal-LM losses, which shift labels); without
    labels, the batch's units (examples, preference pairs, packed sequences).
    """
    labels = inputs.get("shift_labels", inputs.get("labels"))
    if not isinstance(labels, torch.Tensor):
        return (layout or layout_of(trainer, inputs)).count
    if "shift_labels" not in inputs and loss_shifts_labels(trainer):
        labels = labels[..., 1:]
    return int(labels.ne(-100).sum())


def _rows(inputs: Batch) -> int:
    from memtrain.errors import MemtrainError

    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() > 0:
        return int(ids.shape[0])
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise MemtrainError("Out-of-memory recovery: the batch holds no tensor to split. Fix: a data collator "
                        "that returns tensors.")


def _tokens(inputs: Batch) -> int:
    """Completion tokens a GRPO loss averages over (``completion_mask``, times ``tool_mask`` where
    there is one, as TRL masks them)."""
    mask = inputs["completion_mask"]
    if isinstance(inputs.get("tool_mask"), torch.Tensor):
        mask = mask * inputs["tool_mask"]
    return int(mask.sum())


def _along(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def _along_tokens(value: Any, tokens: int) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1
            and value.shape[1] == tokens)


def _stray(inputs: Batch, allowed: tuple[int, ...]) -> str | None:
    """The first tensor (not a scalar) whose first dimension is none of ``allowed``."""
    return next((key for key, value in inputs.items() if isinstance(value, torch.Tensor) and value.dim() > 0
                 and value.shape[0] not in allowed), None)


def _loss_types(trainer: Any) -> list[str]:
    types = getattr(trainer, "loss_types", None) or getattr(getattr(trainer, "args", None), "loss_type", None)
    if isinstance(types, str):
        return [types]
    return list(types or [])
