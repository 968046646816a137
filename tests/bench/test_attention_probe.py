"""The attention-scratch probe (scripts/probes/attention_scratch.py): its CPU-side logic."""

from __future__ import annotations

from scripts.probes import attention_scratch as probe


def test_the_backend_is_read_from_the_kernel_names_the_h200_ran() -> None:
    """cuDNN's SDPA kernels on Hopper carry "flash" in their names too (the H200's profile,
    2026-12-04): they are cuDNN's."""
    cudnn = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26"
    assert probe.kernel_family([cudnn]) == "cudnn"
    assert probe.kernel_family(["void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel"]) == "flash"
    assert probe.kernel_family(["fmha_cutlassB_bf16_aligned_64x64_k64_sm80"]) == "efficient"
    assert probe.kernel_family(["void at::native::elementwise_kernel"]) == "math"


def test_the_model_layout_hands_sdpa_what_a_transformers_attention_layer_does() -> None:
    """The "model" rows (the H200's flash backend allocated 4 bytes x tokens x heads x head_dim more
    than the formula in the contiguous layout: kernel or copy?) must give SDPA transposed views of
    [batch, tokens, heads, head_dim] and a gradient laid out as o_proj's backward returns it; the
    "bhsd" rows the contiguous tensors."""
    import torch

    leaves, q, k, v, grad_like = probe.inputs(4, 2, 8, 16, "model", "cpu")
    assert q.shape == (1, 4, 16, 8) and k.shape == v.shape == (1, 2, 16, 8)
    assert not q.is_contiguous() and q.transpose(1, 2).is_contiguous() and leaves[0].shape == (1, 16, 4, 8)
    grad = grad_like(torch.empty(1, 4, 16, 8, dtype=torch.bfloat16))
    assert grad.shape == (1, 4, 16, 8) and grad.transpose(1, 2).is_contiguous()
    leaves, q, k, v, grad_like = probe.inputs(4, 2, 8, 16, "bhsd", "cpu")
    assert q.is_contiguous() and q is leaves[0] and grad_like(q).is_contiguous()
    runs = probe.runs()
    assert {(r[5], r[6]) for r in runs if r[5] == "model"} == {("model", b) for b in probe.MODEL_LAYOUT}
    assert len(runs) == len(probe.SHAPES) * (len(probe.BACKENDS) + len(probe.MODEL_LAYOUT))
