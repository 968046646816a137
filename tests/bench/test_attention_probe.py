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


def test_the_flash_formula_gets_sdpas_layout() -> None:
    """The 317M row at 64,768 tokens (16 heads, 8 key/value heads, head_dim 64): softmax_d, the
    fp32 dq accumulator and the two expanded GQA gradients."""
    tokens, heads, dim = 64768, 16, 64
    expected = heads * tokens * 4 + tokens * heads * dim * 4 + 2 * tokens * heads * dim * 2
    assert probe.flash_formula(heads, 8, dim, tokens) == expected == 534_724_608
    assert probe.flash_formula(heads, heads, dim, tokens) == expected - 2 * tokens * heads * dim * 2
