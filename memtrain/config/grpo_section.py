"""The training objective and the GRPO settings of the ``training`` section (``training.grpo_*``).

GRPO (``training.objective: grpo``) trains on prompts (``data.format: prompt``): TRL's
``GRPOTrainer`` samples ``grpo_num_generations`` completions of every prompt, scores them with the
reward functions the recipe names (:mod:`memtrain.trainer.rewards`), and pushes the policy toward
the completions that score above their group's mean. The fields sit beside DPO's ``dpo_*`` ones in
``training``; :class:`ObjectiveFields` is the base of :class:`memtrain.config.schema.TrainingConfig`
so that the schema module stays short. The checks that involve other sections are
:func:`grpo_problems` (the trainer's own, those that need TRL or the reward code, run at validate
time in :mod:`memtrain.trainer.grpo`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from memtrain.config.base import Problem, Section

BUILTIN_REWARDS = ("format", "exact_answer")


class ObjectiveFields(Section):
    """What a step optimises, and GRPO's settings (DPO's follow in TrainingConfig)."""

    objective: Literal["sft", "dpo", "grpo"] = Field(
        "sft",
        description="`sft`: the model's own loss on the data (next-token prediction, classification); "
        "`dpo`: preference optimisation on `data.format: preference` pairs with TRL's `DPOTrainer` "
        "(the reference model is the base with the LoRA adapter disabled, or a frozen copy in full "
        "fine-tuning); `grpo`: online RL on `data.format: prompt` prompts with TRL's `GRPOTrainer` "
        "(completions sampled with Hugging Face generation, scored by `grpo_rewards`).",
    )
    grpo_rewards: list[str] = Field(
        default_factory=list,
        description="GRPO: the reward functions, summed (weighted by `grpo_reward_weights`): `format` "
        "(1 if the completion matches `grpo_format_pattern`, else 0), `exact_answer` (1 if the "
        "completion, stripped and case-folded, equals the row's `grpo_answer_column`, else 0), or "
        "`module:function` for your own (TRL's reward signature: `f(prompts, completions, "
        "completion_ids, **columns) -> list[float]`; imported and called once on a sample row when the "
        "recipe is validated). At least one.",
    )
    grpo_reward_weights: list[float] | None = Field(
        None, description="GRPO: one weight per reward function (TRL's `reward_weights`); null: all 1.")
    grpo_format_pattern: str = Field(
        r"^\s*\w[\w' ]*\s*$",
        description="GRPO: the regular expression the `format` reward checks (Python `re.fullmatch` on "
        "the completion's text); by default a short answer of words only.",
    )
    grpo_answer_column: str = Field(
        "answer", description="GRPO: the data column holding each prompt's answer (`exact_answer`).")
    grpo_num_generations: int = Field(
        8, ge=2,
        description="GRPO: completions sampled per prompt (the group whose mean reward is the baseline). "
        "Completions per optimizer step (micro_batch_size × gradient_accumulation × processes: "
        "`micro_batch_size` counts completions) must be a multiple of it (TRL's rule).",
    )
    grpo_max_completion_length: int = Field(
        256, gt=0, description="GRPO: the most tokens a completion may have (the memory estimate's "
        "worst case: every completion this long).")
    grpo_temperature: float = Field(1.0, gt=0, description="GRPO: the sampling temperature.")
    grpo_top_p: float = Field(
        1.0, gt=0, le=1, description="GRPO: nucleus sampling, the probability mass kept (TRL's `top_p`); "
        "1: off. Below 1 the sampling step holds 5.5 more rows x vocabulary fp32 tensors (its sort; 6.5 "
        "after another processor such as a temperature), which the estimate counts.")
    grpo_top_k: int = Field(
        0, ge=0, description="GRPO: sample from the k most likely tokens only (TRL's `top_k`); 0: off.")
    grpo_min_p: float | None = Field(
        None, ge=0, le=1, description="GRPO: drop tokens below this fraction of the most likely one's "
        "probability (TRL's `min_p`); null: off.")
    grpo_repetition_penalty: float = Field(
        1.0, gt=0, description="GRPO: penalty on tokens already in the prompt or completion (TRL's "
        "`repetition_penalty`); 1: off.")
    grpo_beta: float = Field(
        0.0, ge=0,
        description="GRPO: the KL coefficient toward the reference model (TRL's `beta`); 0: no reference "
        "pass. With LoRA the reference is the base model with the adapter disabled (no second copy).",
    )
    grpo_loss: str = Field(
        "dapo",
        description="GRPO: TRL's `loss_type`; checked against the values the installed TRL lists "
        "(TRL 1.16: `grpo`, `dr_grpo`, `dapo`, `bnpo`, `cispo`, `sapo`, `luspo`, `vespo`).",
    )


def grpo_problems(sections: Mapping[str, Any]) -> list[Problem]:
    """``training.objective: grpo`` and ``data.format: prompt`` go together; what GRPO needs of the
    other sections (no TRL imported here: the loss type and the reward code are checked in
    :mod:`memtrain.trainer.grpo`)."""
    t, data, model = sections.get("training"), sections.get("data"), sections.get("model")
    if t is None or data is None:
        return []
    prompts = any(d.kind == "prompt" for d in data.datasets())
    if t.objective != "grpo":
        if prompts:
            return [Problem("data.format", "prompt", "prompts without answers are trained by online RL, "
                            f"not by `training.objective: {t.objective}`", "set `training.objective: "
                            "grpo` (with `training.grpo_rewards`), or use a format with answers.")]
        return []
    out = []
    if data.kind != "prompt" or data.mix:
        out.append(Problem("training.objective", "grpo", f"needs prompts, and `data.format` is "
                           f"`{data.format}`{' with `data.mix`' if data.mix else ''}",
                           "set `data.format: prompt` (a prompt column: a string or a list of "
                           "{role, content} messages; see docs/DATA.md), one dataset."))
    if not t.grpo_rewards:
        out.append(Problem("training.grpo_rewards", [], "is empty: GRPO learns only from rewards",
                           "name at least one: `format`, `exact_answer` (against "
                           "`training.grpo_answer_column`), or `module:function` for your own."))
    for name in t.grpo_rewards:
        if name not in BUILTIN_REWARDS and (name.count(":") != 1 or not all(name.split(":"))):
            out.append(Problem("training.grpo_rewards", name, "is neither a built-in reward nor "
                               "`module:function`", f"use one of {', '.join(BUILTIN_REWARDS)}, or "
                               "`package.module:function` importable from this environment."))
    if t.grpo_reward_weights is not None and len(t.grpo_reward_weights) != len(t.grpo_rewards):
        out.append(Problem("training.grpo_reward_weights", t.grpo_reward_weights,
                           f"has {len(t.grpo_reward_weights)} weights for {len(t.grpo_rewards)} reward "
                           "functions", "give one weight per entry of `training.grpo_rewards`, or null."))
    out += _generation_batch(sections)
    if model is not None and model.task != "causal-lm":
        out.append(Problem("training.objective", "grpo", f"trains a causal LM, not `{model.task}`",
                           "set `model.task: causal-lm`."))
    adapter, memory = sections.get("adapter"), sections.get("memory")
    if adapter is not None and adapter.method == "full" and t.grpo_beta > 0:
        out.append(Problem("training.grpo_beta", t.grpo_beta, "needs a reference model; memtrain's is "
                           "the base with the LoRA adapter disabled (full fine-tuning would need a "
                           "second, frozen copy, which memtrain does not build or plan)",
                           "set `adapter.method: lora`, or `training.grpo_beta: 0`."))
    if memory is not None and memory.loss == "chunked":
        out.append(Problem("memory.loss", "chunked", "does not apply to GRPO: TRL's GRPOTrainer computes "
                           "the completions' log-probabilities itself", "set `memory.loss: standard`."))
    distributed = sections.get("distributed")
    if distributed is not None and distributed.processes > 1:
        out.append(Problem("training.objective", "grpo", f"runs in one process here "
                           f"(`distributed.processes: {distributed.processes}`)",
                           "set `distributed.processes: 1`."))
    return out


def _generation_batch(sections: Mapping[str, Any]) -> list[Problem]:
    """TRL 1.16 (``GRPOConfig.__post_init__``): the generation batch, per-device batch × processes ×
    steps_per_generation (= gradient accumulation), must be a multiple of ``num_generations``."""
    t, distributed = sections["training"], sections.get("distributed")
    procs = distributed.processes if distributed is not None else 1
    micro, accum, eff = t.micro_batch_size, t.gradient_accumulation, t.effective_batch_size
    g = t.grpo_num_generations
    if isinstance(micro, int) and isinstance(accum, int):
        total, how = micro * accum * procs, f"{micro} × {accum} × {procs}"
    elif eff is not None:
        total, how = eff, "training.effective_batch_size"
    else:
        return []
    if total % g == 0:
        return []
    return [Problem("training.grpo_num_generations", g, f"does not divide the completions per optimizer "
                    f"step, micro_batch_size × gradient_accumulation × processes = {how} = {total} (TRL "
                    "generates whole groups of num_generations completions per prompt)",
                    f"make micro_batch_size × gradient_accumulation a multiple of {g} (e.g. "
                    f"`training.micro_batch_size: {g}`), or choose a num_generations that divides {total}.")]
