"""What CUDA's attention kernels allocate for themselves: per SDPA backend, forward and backward.

    python -m scripts.probes.attention_scratch --out $OUT/attention_scratch.json    # on a GPU, ~20 s

Why (issue 39): on the H200 (2026-12-04) the steps' attention ran cuDNN's kernels
(``_cudnn_attention_backward`` in the profile), while a CUDA estimate holds FlashAttention-2's
backward scratch (``memtrain.estimator.trace_events.flash_backward_scratch``), and no fake tensor
shows a kernel's own memory. That session's long row matched once the activation offload's
prefetch was counted, so at its shape the two kernels' scratch agreed to within 0.03%; this probe
measures each backend alone, on the benchmarks' shapes, so that the agreement is known, not
inferred from one row.

For each shape and backend (cuDNN, flash, memory-efficient, and PyTorch's own choice): q, k, v in
bf16 with grad, causal; GQA through ``enable_gqa`` as transformers' SDPA path passes it when no mask
is given. Measured with ``torch.cuda.max_memory_allocated`` around the forward and the backward,
less what each returns (the output and what autograd keeps; the three gradients): the kernel's
scratch. The default's backend is read from the profiler's kernel names. Nothing here comes from
memtrain (the measured side shares no code with what it checks): hold the rows against
``memtrain.estimator.trace_events.flash_backward_scratch`` afterwards, on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

# (label, heads, kv_heads, head_dim, tokens): the 317M row of 2026-12-04, the 1B shape, a plain one
SHAPES = [
    ("317M, 64,768 tokens", 16, 8, 64, 64768),
    ("317M, 16,384 tokens", 16, 8, 64, 16384),
    ("317M heads unrepeated", 16, 16, 64, 64768),
    ("1.24B, 32,768 tokens", 32, 8, 64, 32768),
    ("1.24B, 106,752 tokens", 32, 8, 64, 106752),
    ("8B, 32,768 tokens", 32, 8, 128, 32768),
]
BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", None)  # None: PyTorch's choice
# The H200 (2026-12-04): cuDNN's backward scratch (PyTorch's choice there) matched the flash formula
# the estimate holds within 0.8% on every shape; the forced flash backend allocated a further
# 4 bytes x tokens x heads x head_dim in this probe's contiguous [b, h, s, d] layout. Whether that
# is the kernel or a copy for the layout is what the "model" layout rows (as transformers' attention
# passes the tensors) settle, for flash and PyTorch's choice.
MODEL_LAYOUT = ("FLASH_ATTENTION", None)


def runs() -> list[tuple[str, int, int, int, int, str, str | None]]:
    """Every probe: each shape under each backend in the "bhsd" layout, then in the "model" layout
    under :data:`MODEL_LAYOUT`'s backends."""
    out = [(*shape, "bhsd", backend) for shape in SHAPES for backend in BACKENDS]
    return out + [(*shape, "model", backend) for shape in SHAPES for backend in MODEL_LAYOUT]


def kernel_family(names: list[str]) -> str:
    """Which backend ran, from the profiler's kernel names."""
    text = " ".join(names).lower()
    for needle, family in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"),
                           ("efficient", "efficient"), ("mem_eff", "efficient")):
        if needle in text:
            return family
    return "math" if text else "unknown"


def inputs(heads: int, kv_heads: int, head_dim: int, tokens: int, layout: str,
           device: str) -> tuple[Any, ...]:
    """``(leaves, q, k, v, grad)`` in bf16: ``layout`` ``"bhsd"`` makes q, k, v contiguous
    ``[batch, heads, tokens, head_dim]`` leaves and the output's gradient like the output;
    ``"model"`` as a transformers attention layer hands them to SDPA: transposed views of
    ``[batch, tokens, heads, head_dim]`` projections, and the gradient arriving from ``o_proj``
    contiguous ``[batch, tokens, heads * head_dim]`` (a kernel that wants another layout copies)."""
    import torch

    def leaf(*shape: int) -> Any:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)

    if layout == "bhsd":
        leaves = (leaf(1, heads, tokens, head_dim), leaf(1, kv_heads, tokens, head_dim),
                  leaf(1, kv_heads, tokens, head_dim))
        q, k, v = leaves
        return leaves, q, k, v, lambda o: torch.randn_like(o)
    leaves = (leaf(1, tokens, heads, head_dim), leaf(1, tokens, kv_heads, head_dim),
              leaf(1, tokens, kv_heads, head_dim))
    q, k, v = (t.transpose(1, 2) for t in leaves)

    def from_o_proj(o: Any) -> Any:
        flat = torch.randn(1, tokens, heads * head_dim, device=device, dtype=o.dtype)
        return flat.view(1, tokens, heads, head_dim).transpose(1, 2)

    return leaves, q, k, v, from_o_proj


def measure(heads: int, kv_heads: int, head_dim: int, tokens: int, backend: str | None,
            layout: str = "bhsd") -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.cuda
    leaves, q, k, v, grad_like = inputs(heads, kv_heads, head_dim, tokens, layout, "cuda")
    gqa = kv_heads != heads
    context = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext()
    out: dict[str, Any] = {}
    try:
        with context:
            cuda.synchronize()
            base = cuda.memory_allocated()
            cuda.reset_peak_memory_stats()
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            cuda.synchronize()
            kept = cuda.memory_allocated() - base  # the output and what autograd saved
            out["forward_kept"] = kept
            out["forward_scratch"] = cuda.max_memory_allocated() - base - kept
            grad = grad_like(o)
            cuda.synchronize()
            base = cuda.memory_allocated()
            cuda.reset_peak_memory_stats()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                o.backward(grad)
                cuda.synchronize()
            grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves)
            out["backward_scratch"] = cuda.max_memory_allocated() - base - grads
            out["kernel"] = kernel_family([e.key for e in prof.key_averages()])
    except Exception as err:  # a backend that refuses the shape is a row, not the end of the probe
        out["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("attention_scratch measures CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    rows = []
    for label, heads, kv_heads, head_dim, tokens, layout, backend in runs():
        row = {"shape": label, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
               "tokens": tokens, "backend": backend or "default", "layout": layout,
               **measure(heads, kv_heads, head_dim, tokens, backend, layout)}
        rows.append(row)
        torch.cuda.empty_cache()
        mib = {k: round(v / 2**20, 1) for k, v in row.items()
               if k.endswith(("scratch", "kept"))}
        print(json.dumps({"shape": label, "backend": row["backend"], "layout": layout,
                          "kernel": row.get("kernel"), "error": row.get("error"), **mib}), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
