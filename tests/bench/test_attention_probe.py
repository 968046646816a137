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
