"""The training phase of ``training.objective: grpo`` before any weight loads: TRL's own GRPO step, traced.

``memtrain estimate`` and ``memtrain plan`` of a GRPO recipe trace what ``memtrain train`` will run:
the recipe's model is built on fake tensors (:func:`memtrain.estimator.fake.build_fake_model`, the
same adapter and patches), TRL's ``GRPOTrainer`` (memtrain's
:class:`~memtrain.trainer.grpo.MemtrainGRPOTrainer`, through the same ``GRPOConfig`` as training) is
built around it, and its own ``training_step`` runs on the worst-case generation output
(:func:`memtrain.estimator.grpo.step_batch`: every completion ``grpo_max_completion_length`` tokens
after a prompt of ``data.max_length`` tokens, or of the data's longest prompt with ``--data``),
without generating (:func:`memtrain.estimator.trainer_loss.trace_training_step`).
That is what a causal-LM trace of the same rows misses: TRL scores completions through its fused
log-probability head with entropy, on a CPU over every position of prompt + completion, in fp32
tiles of rows × tokens × vocabulary (about eight of them at the peak).

The trace records the decoder layer of every op, so a deep model is traced at 2 and 3 layers and
extrapolated like any recipe (:mod:`memtrain.estimator.trace`). The Trainer is built with one
placeholder prompt and reward functions that return zeros: neither the data nor the rewards take
part in the training step. Its ``per_device_train_batch_size`` is one group of
``grpo_num_generations`` (any traced micro-batch may not divide into groups; TRL checks that at
construction); the traced micro-batch is the rows of the batch.

Not traced here (:func:`trace_reason` says why, and the estimate falls back to the causal-LM
approximation, :func:`grpo_notes`): a CUDA run (TRL's fused head then runs
Triton kernels, which fake tensors cannot run, and scores only the completion tokens), several
processes, a tokenizer that cannot be loaded here (TRL's Trainer needs one).
"""

from __future__ import annotations

import contextlib
import random
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PretrainedConfig

from memtrain import patches
from memtrain.config import RunConfig
from memtrain.config.batch import Batch, resolve_batch
from memtrain.errors import recipe_stage
from memtrain.estimator.fake import build_fake_model, fake_tensor_mode, quiet_libraries
from memtrain.estimator.grpo import generation_phase, step_batch
from memtrain.estimator.layers import decoder_layers
from memtrain.estimator.trace import Trace, Work
from memtrain.estimator.trainer_loss import trace_training_step
from memtrain.memory import loops
from memtrain.model import count_parameters

if TYPE_CHECKING:
    from memtrain.estimator.setup import TraceSetup


def recipe_trace(plan: TraceSetup, depth: int, micro_batch: int, seq_len: int) -> Trace | None:
    """The estimator's trace of a GRPO recipe at ``depth`` layers (None where :func:`trace_reason`
    gives a reason: the caller traces the causal-LM step instead)."""
    if trace_reason(plan.cfg, plan.device) is not None:
        return None
    from memtrain.estimator.trace import with_depth

    return trace_grpo_step(plan.cfg, with_depth(plan.config, depth), micro_batch, seq_len,
                           padded=plan.rows.padded(micro_batch), cuda_kernels=plan.device == "cuda")


def grpo_notes(cfg: RunConfig, device: str, prompt_tokens: int, resident: int | None = None) -> list[str]:
    """What ``memtrain estimate`` states of a GRPO recipe: which training step was traced, and the
    generation phase, an analytic estimate beside it (never summed). ``prompt_tokens``: the traced
    prompt length (``data.max_length``, or the data's longest prompt); ``resident``: the weights,
    buffers and optimizer state the generation runs beside (default: the weights)."""
    t = cfg.training
    reason = trace_reason(cfg, device)
    if reason is None:
        training = (f"GRPO: the training phase above is TRL's own GRPOTrainer training_step traced on "
                    f"fake tensors: {t.micro_batch_size} completions of {t.grpo_max_completion_length} "
                    f"tokens after {prompt_tokens}-token prompts (every completion at full length), "
                    "through its fused log-prob head with entropy; no generation in it")
    else:
        training = (f"GRPO: the training phase above is traced as the causal-LM step of {t.micro_batch_size} "
                    f"rows (completions) of {prompt_tokens} tokens, not TRL's GRPO step ({reason}): an "
                    "approximation, usually low (TRL's fused log-prob head with entropy holds several fp32 "
                    f"tiles of rows x tokens x vocabulary; +{t.grpo_max_completion_length} completion tokens "
                    f"and the reference log-probs at beta {t.grpo_beta} are not in it). memtrain train "
                    "traces TRL's own training step on the built Trainer before the first step and logs that")
    batch = resolve_batch(t, cfg.distributed.processes)
    # TRL generates a whole generation batch at once: micro-batch x steps_per_generation (= accumulation)
    generation = generation_phase(cfg, prompt_tokens, batch.micro * batch.accumulation, resident)
    return [training, generation.describe() + "; a separate phase, not added to the training peak"]


def trace_reason(cfg: RunConfig, device: str) -> str | None:
    """Why TRL's GRPO step cannot be traced for this recipe here (None: it can)."""
    if device != "cpu":
        return ("on CUDA TRL's fused log-prob head runs Triton kernels, which cannot run on fake tensors "
                "(and it scores only the completion tokens there)")
    if cfg.distributed.processes > 1:
        return "GRPO is traced for one process"
    try:
        import trl  # noqa: F401
    except ImportError:
        return "TRL is not installed"
    try:
        _tokenizer(cfg)
    except Exception as err:  # offline, not cached: the Trainer needs a tokenizer
        return f"the tokenizer could not be loaded here ({type(err).__name__}: {str(err)[:200]})"
    return None


def trace_grpo_step(cfg: RunConfig, config: PretrainedConfig, batch_size: int, seq_len: int,
                    padded: bool = True, cuda_kernels: bool = False) -> Trace:
    """One optimizer step of TRL's GRPOTrainer for ``cfg`` on fake tensors (see the module docstring):
    ``batch_size`` completions after ``seq_len``-token prompts, on a CPU; ``cuda_kernels``: for CUDA
    (:func:`memtrain.estimator.trace.trace_step`)."""
    settings = resolve_batch(cfg.training, cfg.distributed.processes)
    accumulation = min(settings.accumulation, 2)  # a third micro-batch looks like the second
    tokenizer = _tokenizer(cfg)
    with fake_tensor_mode(padded=padded, scalars=True) as mode, quiet_libraries(), _kept_rng(), \
            tempfile.TemporaryDirectory(prefix="memtrain-grpo-") as out:
        model = build_fake_model(cfg, config)
        total, trainable = count_parameters(model)
        with recipe_stage("training", "building TRL's GRPOTrainer"):
            trainer = _trainer(cfg, model, tokenizer, settings, out)
        batch = step_batch(trainer, batch_size, prompt=seq_len)
        layers = decoder_layers(model)
        with recipe_stage("model", "TRL's GRPO training step on fake tensors"), loops.recording():
            tracker = trace_training_step(trainer, mode, batch, accumulation, layers, cuda_kernels)
            marked = loops.loops()
        done = [r.detail or r.name for r in patches.records(model)]
    work = Work(1, float(tracker.flops), tracker.ops["step"], tracker.written, tracker.ops["optimizer"],
                *tracker.recomputed())
    rows = np.array(tracker.rows, dtype=np.int64)
    marks = np.array(tracker.marks, dtype=np.int64).reshape(-1, 4)
    return Trace(tracker.phases, rows[:, 0], rows[:, 1], rows[:, 2:], total, trainable, done, work,
                 marks, marked)


def _trainer(cfg: RunConfig, model: Any, tokenizer: Any, settings: Batch, out: str) -> Any:
    """memtrain's GRPOTrainer around the fake model, as :func:`memtrain.trainer.grpo.build_grpo_trainer`
    builds it, with one placeholder prompt and zero rewards (neither is used by the training step)."""
    from datasets import Dataset

    from memtrain.trainer.grpo import MemtrainGRPOTrainer, grpo_arguments
    from memtrain.trainer.trainer import trainer_options

    group = cfg.training.grpo_num_generations
    args = grpo_arguments(cfg, Batch(micro=group, accumulation=settings.accumulation, processes=1),
                          out, has_eval=False)
    funcs = [_zero_reward] * len(cfg.training.grpo_rewards)
    prompts = Dataset.from_list([{"prompt": "placeholder", cfg.training.grpo_answer_column: ""}])
    return MemtrainGRPOTrainer(**trainer_options(cfg), recover_oom=False, model=model, reward_funcs=funcs,
                               args=args, train_dataset=prompts, processing_class=tokenizer)


def _zero_reward(completions: list[Any], **_: Any) -> list[float]:
    return [0.0] * len(completions)


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(cfg: RunConfig) -> Any:
    """The recipe's tokenizer (no weights), loaded once per model section."""
    from memtrain.model import load_tokenizer

    key = cfg.model.model_dump_json()
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(cfg.model)
    return _TOKENIZERS[key]


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    """The Trainer's constructor seeds every generator (``set_seed``): put them back after it."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
