"""The ``data`` section of the recipe schema: one dataset's settings and the mix of several."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    PrivateAttr,
    ValidationInfo,
    create_model,
    model_validator,
)

from memtrain.config.base import Auto, FractionOr, Problem, Section, report_problem

# ---------------------------------------------------------------------------------------- data

DataFormat = Literal["text", "completion", "instruction", "alpaca", "sharegpt", "messages", "chat",
                     "tokenized", "classification", "preference", "prompt"]
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


def _positive_length(v: int | str) -> int | str:
    if isinstance(v, int) and v <= 0:
        raise ValueError("must be greater than 0")
    return v


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
        "`classification`: text + label; `preference`: prompt/chosen/rejected columns (strings, or "
        "lists of `{role, content}` messages rendered with `chat_template`) for "
        "`training.objective: dpo`; `prompt`: prompts only (`prompt_column`: a string, or a list of "
        "`{role, content}` messages rendered with `chat_template`) for `training.objective: grpo`, the "
        "other columns passed to the reward functions. `sharegpt` and `messages` are rendered with "
        "`chat_template`. "
        "`instruction` is an alias of `completion`, `chat` of `messages`.",
    )
    split: str = Field("train", description="Split to train on.")
    subset: str | None = Field(None, description="Dataset configuration name on the hub.")
    text_column: str = Field("text", description="Column holding the text (text, classification).")
    label_column: str = Field("label", description="Column holding the label (classification).")
    prompt_column: str = Field("prompt",
                               description="Column holding the prompt (completion, preference, prompt).")
    response_column: str = Field("response", description="Column holding the answer (completion).")
    chosen_column: str = Field("chosen", description="Column holding the preferred answer (preference).")
    rejected_column: str = Field("rejected",
                                 description="Column holding the dispreferred answer (preference).")
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

    max_length: Annotated[int | Auto, AfterValidator(_positive_length)] = Field(
        512, description="Longest tokenized example; longer ones are cut (a warning says how many). "
        "`auto`: the planner finds the longest that fits the budget with the recipe's other settings "
        "and every `auto` technique (a multiple of 256 tokens, or the data's longest row, past which "
        "`memtrain train` and `memtrain plan --data` do not search unless packing; `memtrain plan` "
        "shows it).")
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
                    report_problem(info, Problem(
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
            report_problem(info, Problem(
                "data.mix", [e.source for e in self.mix], f"mixing is for causal-LM data, and "
                f"`data.format` is `{self.format}`", "remove `data.mix` (train on one dataset), or mix "
                "causal-LM data (text, completion, alpaca, sharegpt, messages or tokenized).",
            ))
            return self
        for i, entry in enumerate(self.mix):
            own = {k for k, v in entry.model_dump().items() if v is not None}
            found: list[Problem] = []
            merged = DataConfig.model_validate(self._merged(entry), context={"problems": found})
            for problem in found:
                key = problem.path.removeprefix("data.")
                if key in own:
                    report_problem(info, replace(problem, path=f"data.mix[{i}].{key}"))
            if merged.kind not in CAUSAL_FORMATS:
                report_problem(info, Problem(
                    f"data.mix[{i}].format", merged.format, "mixed datasets must be causal-LM data "
                    "(all of them train one next-token objective)",
                    f"use one of {', '.join(CAUSAL_FORMATS)}, or remove this entry.",
                ))
        return self

    @model_validator(mode="after")
    def _packing_causal_only(self, info: ValidationInfo) -> DataConfig:
        if self.packing and self.kind not in CAUSAL_FORMATS:
            report_problem(info, Problem(
                "data.packing", True, f"packing applies to causal-LM formats, not `{self.format}`",
                "remove `data.packing`.",
            ))
        for key, names in (("completion_template", ("prompt",)),
                           ("alpaca_template", ("instruction", "input")),
                           ("alpaca_template_no_input", ("instruction",))):
            missing = [n for n in names if "{" + n + "}" not in getattr(self, key)]
            if missing:
                report_problem(info, Problem(
                    f"data.{key}", getattr(self, key), f"has no {', '.join('{' + n + '}' for n in missing)}",
                    "put the placeholder where the column's text goes.",
                ))
        roles = {"user", "assistant", "system", "tool"}
        bad = {k: v for k, v in self.sharegpt_roles.items() if v not in roles}
        if bad:
            report_problem(info, Problem(
                "data.sharegpt_roles", bad, "maps to unknown roles",
                f"map each name to one of {', '.join(sorted(roles))}.",
            ))
        return self
