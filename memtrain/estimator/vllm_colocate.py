"""vLLM colocated with training (TRL's ``GRPOConfig(use_vllm=True, vllm_mode="colocate")``), planned
in bytes: the ``vllm_gpu_memory_utilization`` a generation batch needs, and what it leaves training.

In colocate mode vLLM runs in the training process and takes ``ceil(total × utilization)`` bytes of
the GPU (``total``: the device's whole memory, not a budget) at start-up. It fills what its own
profile leaves of that share with KV cache; TRL's default share (0.3, lowered from 0.9 after OOM
reports) is a guess, too much for a small model on a big card and too little for long completions.
:func:`colocate_share` computes it from what can be counted, following vLLM's sizing rules (v1
engine, read in ``vllm/v1/worker/gpu_worker.py`` and ``vllm/v1/core/kv_cache_utils.py``):

- **requested** = ``ceil(total × utilization)``; vLLM refuses to start when the device's free memory
  at start-up is below it (the training model's weights are already there in colocate mode);
- **KV cache** = requested − (vLLM's weights + the peak of its profile run + memory outside torch
  that the profile run grew), split into blocks of ``block_size`` (16) tokens: a block holds the key
  and value of every layer, ``2 × block_size × kv_heads × head_dim × dtype`` bytes per layer;
- one block is held back (the block pool's null block), and at least one request of
  ``max_model_len`` tokens must fit the rest, else vLLM stops with "… KV cache is needed, which is
  larger than the available KV cache memory". ``max_model_len`` is TRL's ``vllm_max_model_length``, or
  the model's positions when unset (131,072 for Llama-3.1: 16 GiB of KV cache for an 8B model);
- the weights in the dtype vLLM picks by itself: the config's, with float32 models in bfloat16 (as
  vLLM's "auto" dtype on a GPU that has it); bitsandbytes 4-bit where the trained model is (TRL then
  passes ``quantization="bitsandbytes"``).

Here the generation batch (``generation_batch_size`` completions per process, generated at once,
each at most prompt + ``max_completion_length`` tokens) must fit the KV cache at full length, so no
request waits or is preempted. What cannot be counted without vLLM on a GPU is an allowance, named
below and not yet measured (issue 39's GPU rows): the profile run's activations (a forward of
``max_num_batched_tokens`` tokens, 4,096 as TRL sets it, and the sampler's fp32 logits for
``max_num_seqs`` rows), the memory outside torch it grows (:data:`NON_TORCH_ALLOWANCE`) and the CUDA
graphs vLLM captures after sizing, outside the requested share (:data:`CUDA_GRAPH_ALLOWANCE`).
Allowances too small leave a smaller KV cache (fewer sequences at once: slower generation, not an
out-of-memory error); too large waste the difference.

With ``vllm_enable_sleep_mode`` TRL puts vLLM to sleep (level 2: weights and KV cache released)
after each generation, so the training step has the GPU without vLLM's share; generation then holds
the training model's resident state and vLLM's share together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = 16  # vLLM's default tokens per KV-cache block on CUDA
MAX_NUM_BATCHED_TOKENS = 4096  # TRL's colocated LLM(...) sets it (vLLM's profile run is this long)
NON_TORCH_ALLOWANCE = 512 * 2**20  # NCCL / cuBLAS workspaces the profile run grows: unmeasured
CUDA_GRAPH_ALLOWANCE = 512 * 2**20  # graphs captured after sizing, outside the share: unmeasured
SAMPLER_FP32_COPIES = 3  # the sampler's logits in fp32, processed logits and probabilities (assumed)
STEP = 0.01  # the utilization is rounded up to this


@dataclass(frozen=True)
class ColocateShare:
    """vLLM's share of a GPU for a generation batch (bytes), and the utilization that asks for it."""

    total: int  # the device's memory: vLLM's utilization is a fraction of this
    utilization: float
    weights: int  # vLLM's copy of the weights
    profile: int  # its profile run's peak (activations, sampler logits): an allowance
    non_torch: int  # what the profile run grows outside torch: an allowance
    cuda_graphs: int  # captured after sizing, beyond the requested share: an allowance
    block_bytes: int  # one KV-cache block: every layer's key and value for BLOCK_SIZE tokens
    blocks_needed: int  # the generation batch at full length, plus the null block
    sequences: int  # completions generated at once (vLLM's max_num_seqs)
    length: int  # tokens of each: prompt + max_completion_length
    max_model_len: int  # what vLLM is told (its one-request check is for this length)
    sleep: bool = False

    @property
    def requested(self) -> int:
        """What vLLM takes at start-up: ``ceil(total × utilization)``."""
        return math.ceil(self.total * self.utilization)

    @property
    def kv_cache(self) -> int:
        """The KV cache vLLM will allocate from the share (if its profile matches the allowances)."""
        return self.requested - self.weights - self.profile - self.non_torch

    @property
    def concurrent(self) -> int:
        """Sequences of ``length`` tokens the KV cache holds at once."""
        blocks = self.kv_cache // self.block_bytes - 1  # less the null block
        return blocks // math.ceil(self.length / BLOCK_SIZE)

    @property
    def fits(self) -> bool:
        """Whether the KV cache holds the generation batch at full length (and vLLM starts)."""
        return self.kv_cache >= self.blocks_needed * self.block_bytes

    @property
    def held(self) -> int:
        """What vLLM holds of the GPU while training runs: its share and graphs; with sleep mode
        only the graphs (weights and KV cache are released until the next generation)."""
        return self.cuda_graphs + (0 if self.sleep else self.requested)

    def describe(self) -> str:
        gib = 2**30
        sleep = ("; vllm_enable_sleep_mode: released while training steps run" if self.sleep else
                 "; held while training steps run too (vllm_enable_sleep_mode=True releases it)")
        return (f"vLLM colocated: vllm_gpu_memory_utilization={self.utilization:.2f} of "
                f"{self.total / gib:,.2f} GiB = {self.requested / gib:,.2f} GiB: weights "
                f"{self.weights / gib:,.2f} + KV cache {self.kv_cache / gib:,.2f} ({self.sequences} "
                f"completions x {self.length:,} tokens at once, {self.blocks_needed:,} blocks of "
                f"{self.block_bytes / 2**20:,.2f} MiB with the null block) + "
                f"allowances for its profile run {self.profile / gib:,.2f} and memory outside torch "
                f"{self.non_torch / gib:,.2f}; CUDA graphs {self.cuda_graphs / gib:,.2f} GiB beyond it "
                f"(allowances: unmeasured){sleep}")


def vllm_dtype_bytes(config_dtype: Any) -> int:
    """Bytes per value of the weights and KV cache vLLM loads (its "auto" dtype on a GPU with
    bfloat16: the config's, float32 models in bfloat16)."""
    name = str(config_dtype).removeprefix("torch.")
    return {"float16": 2, "bfloat16": 2, "float32": 2, "float8_e4m3fn": 1}.get(name, 2)


def kv_block_bytes(text: Any, size: int, block_size: int = BLOCK_SIZE) -> int:
    """One KV-cache block: key and value of ``block_size`` tokens in every layer (vLLM's page size
    of full attention, ``2 × block_size × kv_heads × head_dim × size``, times the layers)."""
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * block_size * kv_heads * head_dim * size * text.num_hidden_layers


def weight_bytes(parameters: int, size: int, quantized: int = 0) -> int:
    """vLLM's copy of the weights: ``parameters`` at ``size`` bytes each, and ``quantized`` more in
    bitsandbytes 4-bit (half a byte and one fp32 absmax per 64 values: the linear layers of a model
    trained in 4-bit; its embeddings and head stay in ``size``)."""
    return parameters * size + quantized // 2 + 4 * math.ceil(quantized / 64)


def profile_bytes(text: Any, size: int, sequences: int, tokens: int = MAX_NUM_BATCHED_TOKENS) -> int:
    """An allowance for the peak of vLLM's profile run: a forward of ``tokens`` tokens (per layer:
    the residual and hidden states, the MLP's gate-and-up output and its activation) and the
    sampler's logits for ``sequences`` rows (the model's dtype and :data:`SAMPLER_FP32_COPIES`)."""
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    forward = tokens * (2 * text.hidden_size + 3 * intermediate) * size
    sampler = min(sequences, tokens) * text.vocab_size * (size + 4 * SAMPLER_FP32_COPIES)
    return forward + sampler


def colocate_share(text: Any, *, total: int, parameters: int, sequences: int, length: int,
                   max_model_len: int | None = None, dtype: Any = "bfloat16", quantized: int = 0,
                   tensor_parallel: int = 1, sleep: bool = False,
                   utilization: float | None = None) -> ColocateShare:
    """The smallest ``vllm_gpu_memory_utilization`` (a multiple of :data:`STEP`) whose KV cache holds
    ``sequences`` completions of ``length`` tokens at once (and vLLM's one-request check at
    ``max_model_len``, default ``length``), for a model with text config ``text``, ``parameters``
    weights in its dtype and ``quantized`` in bitsandbytes 4-bit, on a device of ``total`` bytes;
    or, given ``utilization`` (a vLLM already built with it), that share as it is. With tensor
    parallelism each process holds its share of the weights and of the KV heads (the sequences are
    the whole group's)."""
    size = vllm_dtype_bytes(dtype)
    max_model_len = max_model_len or length
    block = kv_block_bytes(text, size) // tensor_parallel
    per_sequence = math.ceil(length / BLOCK_SIZE)
    blocks = max(sequences * per_sequence, math.ceil(max_model_len / BLOCK_SIZE)) + 1  # + the null block
    weights = weight_bytes(parameters, size, quantized) // tensor_parallel
    profile = profile_bytes(text, size, sequences)
    needed = weights + profile + NON_TORCH_ALLOWANCE + blocks * block
    if utilization is None:
        utilization = round(math.ceil(needed / total / STEP - 1e-9) * STEP, 2)
        while math.ceil(total * utilization) < needed:  # float rounding of the fraction
            utilization = round(utilization + STEP, 2)
    return ColocateShare(total=total, utilization=utilization, weights=weights, profile=profile,
                         non_torch=NON_TORCH_ALLOWANCE, cuda_graphs=CUDA_GRAPH_ALLOWANCE, block_bytes=block,
                         blocks_needed=blocks, sequences=sequences, length=length,
                         max_model_len=max_model_len, sleep=sleep)
