"""The ``memory`` section of the recipe schema: the budget and the memory-saving techniques."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from memtrain.config.base import Auto, FractionOr, Problem, Section, report_problem
from memtrain.units import budget_problem, format_bytes, parse_size

# -------------------------------------------------------------------------------------- memory


class OffloadConfig(Section):
    """What moves to host (CPU) memory during training."""

    activations: bool | Auto = Field(
        False,
        description="Move tensors saved for backward to host memory (pinned, on a side stream on "
        "CUDA) and bring them back for backward. With checkpointing, only layer inputs move.",
    )
    optimizer: bool | Auto = Field(
        False, description="Keep optimizer state (and run the optimizer step) on the CPU."
    )
    embeddings: bool | Auto = Field(
        False,
        description="Keep the frozen input embedding table in host memory: the lookup gathers the "
        "batch's rows on the host and moves only (batch, tokens, hidden) to the device. Saves the "
        "table on the device (1 GiB for Llama-3.1-8B in bf16), costs host RAM for it and one "
        "host-to-device copy of the looked-up rows per micro-batch. Needs a frozen embedding not "
        "tied to the output head (LoRA, QLoRA). `auto`: the planner decides.",
    )
    parameters: bool = Field(
        False, description="With several processes (FSDP): keep sharded parameters on the CPU."
    )
    min_tensor_bytes: int = Field(
        2**20, ge=0, description="Activations smaller than this stay on the device."
    )


class FewBitConfig(Section):
    """Few-bit activation backward (Novikov et al., 2023)."""

    bits: int = Field(3, ge=1, le=4, description="Bits saved per activation element (1-4).")
    targets: list[str] | None = Field(
        None, description="Activation module name patterns; null = every supported activation "
        "module inside the model's repeated blocks."
    )


class RandomizedLinearConfig(Section):
    """Randomized backward for linear layers (Bershatsky et al., 2022)."""

    ratio: float = Field(
        0.2, gt=0, le=1, description="Rows of the saved sketch as a fraction of batch × sequence."
    )
    sketch: Literal["gaussian", "rademacher"] = Field("gaussian", description="Random projection.")
    targets: list[str] | None = Field(
        None, description="Linear module name patterns; null = every trainable linear layer "
        "inside the model's repeated blocks."
    )


Checkpointing = Literal["none", "full", "selective", "auto"]


class MemoryConfig(Section):
    """The memory budget and the techniques that trade compute or accuracy for memory."""

    budget: str | None = Field(
        None,
        description="Memory the run may use per device, like `24GiB`, or `auto` (the device's "
        "free memory; on CPU the available RAM). null = no budget, nothing is planned.",
    )
    host_budget: str = Field(
        "auto",
        description="Host RAM the run may use for what it keeps there (offloaded activations, "
        "optimizer state and embeddings), like `256GiB`, or `auto` (the host RAM free when "
        "planning). Plans whose host bytes exceed it less `margin` are rejected.",
    )
    margin: Annotated[float | Auto, FractionOr] = Field(
        "auto",
        description="Fraction of the budget kept free for what estimates miss. `auto`: 0.1, or 0 "
        "when `simulate_budget` is set (it counts the live tensor bytes the estimator predicts "
        "exactly).",
    )
    simulate_budget: str | None = Field(
        None,
        description="Raise an out-of-memory error when tracked live tensor bytes exceed this size, "
        "e.g. `2GiB` (tests auto-fit and recovery on CPU). When set, it is the budget the run is "
        "planned for, probed against and held to, in place of `budget` (so no larger than `budget`).",
    )
    checkpointing: Checkpointing | int = Field(
        "none",
        description="Activation checkpointing: `none`, `full` (every layer), a number n (the first "
        "n layers), `selective` (recompute cheap element-wise work only) or `auto`.",
    )
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description=OffloadConfig.__doc__)
    activation_bits: int | Auto | None = Field(
        None,
        description="Few-bit activation backward: save this many bits (1-4) per activation input "
        "instead of the input. null = off.",
    )
    activation_targets: list[str] | None = Field(
        None, description="Activation module name patterns for `activation_bits`; null = every "
        "supported activation module inside the model's repeated blocks."
    )
    randomized_linear: RandomizedLinearConfig | Auto | None = Field(
        None, description="Randomized backward for linear layers; null = off."
    )
    allow_approximate: bool = Field(
        False, description="Let the planner choose approximate-gradient layers for `auto` fields."
    )
    loss: Literal["standard", "chunked", "auto"] = Field(
        "standard",
        description="Causal LM loss: `standard` (the model's own: full-vocabulary logits), `chunked` "
        "(output head and cross-entropy over chunks of tokens, each recomputed in backward: full "
        "logits never exist; same loss and gradients) or `auto` (the planner decides).",
    )
    loss_chunk_tokens: int | Auto | None = Field(
        None, description="Tokens per chunk of the chunked loss; null = about as many logits "
        "as hidden-state values (Liger-Kernel's rule), between 32 and 256 MiB of fp32 logits per "
        "chunk, in equal chunks. Larger chunks are faster (fewer head and cross-entropy calls) and "
        "keep more (one chunk's logits exist at a time). `auto`: the planner sizes the chunk from "
        "the budget (1 GiB of fp32 logits, the rule, or 8 MiB).",
    )
    tiled_mlp: bool | Auto = Field(
        False,
        description="Tiled MLP (ALST): every decoder MLP runs over tiles of tokens and recomputes "
        "each tile in backward, so only its input is kept for backward and one tile's intermediate "
        "exists at a time; same loss and gradients, one more MLP forward per step. `auto`: the "
        "planner decides.",
    )
    tiled_mlp_tiles: int | None = Field(
        None, ge=1, description="Tiles per MLP call of the tiled MLP (equal row blocks of the "
        "batch's tokens); null = tiles of hidden_size tokens, the last one shorter (ALST's count, "
        "ceil(tokens / hidden_size), with full tiles so memory never drops as the length grows)."
    )
    tiled_mlp_tile_tokens: int | Auto | None = Field(
        None, description="Tokens per tile of the tiled MLP (every tile full but the last); null = "
        "hidden_size tokens. Smaller tiles keep less (one tile's intermediate exists at a time) and "
        "cost more (4-bit weights are dequantized once per tile and pass). `auto`: the planner sizes "
        "the tiles from the budget (hidden_size, hidden_size / 4 or hidden_size / 16 tokens).",
    )
    lean_norm: bool | Auto = Field(
        False,
        description="Lean RMSNorm (as Liger-Kernel and Unsloth): every RMSNorm keeps only its input "
        "and one fp32 value per token for backward instead of several fp32 copies of its input, and "
        "works over tiles of tokens; same outputs, gradients within rounding, a little element-wise "
        "recompute in backward. Llama-, Gemma-, OLMo-2- and T5-style norms. `auto`: the planner "
        "decides.",
    )
    lean_kbit: bool = Field(
        True,
        description="QLoRA/int8: keep frozen embeddings, output head and norms in the compute dtype "
        "instead of peft's fp32 upcast (`prepare_model_for_kbit_training`). LoRA weights stay fp32.",
    )

    @field_validator("budget", "simulate_budget", "host_budget")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and (why := budget_problem(v)) is not None:
            raise ValueError(why)
        return v

    @property
    def budget_setting(self) -> str | None:
        """The budget a run is planned for, probed against and held to: ``simulate_budget`` when set
        (the run raises an out-of-memory error past it, so a plan for a larger ``budget`` could not
        run), else ``budget`` (a size or ``auto``); None when neither is set. The one rule: the
        planner, the auto-fit probe, the Trainer's guards and every fix that names the field
        (:attr:`budget_field`) read it here."""
        return self.simulate_budget if self.simulate_budget is not None else self.budget

    @property
    def budget_field(self) -> str:
        """The field of :attr:`budget_setting`, as fixes name it."""
        return "memory.simulate_budget" if self.simulate_budget is not None else "memory.budget"

    @property
    def margin_fraction(self) -> float:
        """``margin`` as a number: ``auto`` is 0 when the budget is the simulated one, else 0.1.

        A simulated budget counts live tensor bytes, which the estimator predicts exactly
        (docs/bench/estimate.md); a real device also holds what no trace sees (allocator caching
        and fragmentation, the CUDA context beyond its modelled size, non-tensor RAM).
        """
        if self.margin != "auto":
            return float(self.margin)
        return 0.0 if self.simulate_budget is not None else 0.1

    @field_validator("checkpointing")
    @classmethod
    def _layers(cls, v: str | int) -> str | int:
        if isinstance(v, int) and v < 1:
            raise ValueError("a number of checkpointed layers must be at least 1")
        return v

    @model_validator(mode="after")
    def _simulated_within_budget(self, info: ValidationInfo) -> MemoryConfig:
        """A simulated budget is a smaller device emulated on this one: one larger than
        ``memory.budget`` would plan and hold the run to memory the device does not have."""
        sizes = (self.budget, self.simulate_budget)
        if None in sizes or "auto" in sizes or any(budget_problem(s) for s in sizes):
            return self
        budget, simulated = (parse_size(s) for s in sizes)
        if simulated > budget:
            report_problem(info, Problem(
                "memory.simulate_budget", self.simulate_budget,
                f"is larger than `memory.budget` ({format_bytes(budget)}); the run would be planned "
                "for and held to the simulated size, more than the device has",
                f"set `memory.simulate_budget` to at most `{self.budget}`, or raise `memory.budget`.",
            ))
        return self

    @model_validator(mode="after")
    def _tiles(self, info: ValidationInfo) -> MemoryConfig:
        size = self.tiled_mlp_tile_tokens
        if isinstance(size, int) and (isinstance(size, bool) or size < 1):
            report_problem(info, Problem(
                "memory.tiled_mlp_tile_tokens", size, "tokens per tile must be at least 1",
                "use e.g. 1024, `auto` (the planner sizes it), or null for hidden_size.",
            ))
        elif size is not None and self.tiled_mlp_tiles is not None:
            report_problem(info, Problem(
                "memory.tiled_mlp_tile_tokens", size,
                "the tiles are sized twice: `memory.tiled_mlp_tiles` is set too",
                "set one of `memory.tiled_mlp_tiles` (a count) and "
                "`memory.tiled_mlp_tile_tokens` (a size), and null the other.",
            ))
        elif size is not None and self.tiled_mlp is False:
            report_problem(info, Problem(
                "memory.tiled_mlp_tile_tokens", size,
                "sizes tiles, but the tiled MLP is off",
                "set `memory.tiled_mlp: true` (or `auto`), or drop "
                "`memory.tiled_mlp_tile_tokens`.",
            ))
        return self

    @model_validator(mode="after")
    def _chunks(self, info: ValidationInfo) -> MemoryConfig:
        size = self.loss_chunk_tokens
        if isinstance(size, int) and (isinstance(size, bool) or size < 1):
            report_problem(info, Problem(
                "memory.loss_chunk_tokens", size, "tokens per chunk must be at least 1",
                "use e.g. 512, `auto` (the planner sizes it), or null for the rule.",
            ))
        elif size is not None and self.loss == "standard":
            report_problem(info, Problem(
                "memory.loss_chunk_tokens", size,
                "sizes loss chunks, but the loss is `standard` (full logits)",
                "set `memory.loss: chunked` (or `auto`), or drop "
                "`memory.loss_chunk_tokens`.",
            ))
        return self

    @model_validator(mode="after")
    def _bits_range(self, info: ValidationInfo) -> MemoryConfig:
        bits = self.activation_bits
        if isinstance(bits, int) and not 1 <= bits <= 4:
            report_problem(info, Problem(
                "memory.activation_bits", bits, "few-bit backward supports 1 to 4 bits",
                "use 1, 2, 3 or 4 (3 is the usual choice), or null to turn it off.",
            ))
        return self

    @property
    def fewbit(self) -> FewBitConfig | None:
        """The few-bit patch settings, or None when off or undecided."""
        if not isinstance(self.activation_bits, int):
            return None
        return FewBitConfig(bits=self.activation_bits, targets=self.activation_targets)
