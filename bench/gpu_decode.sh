#!/usr/bin/env bash
# The fused decode path on the GPU in one device call, from the repository root:
#   1. bench/ln_linear_sweep.py   tile / split-K sweep of the fused kernels (SWEEP=0 skips it)
#   2. the inference test files on the GPU (fused kernels, decode kernel, generation), bf16 included
#   3. bench/generate.py   decode variants side by side (fused and not, graph and not, plain PyTorch)
#   4. bench/profile_gpu.py --only decode   kernels per fused decode step, batch 1 and 16
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
T0=$(date +%s)
LOG="$OUT/gpu_decode.log"
nvidia-smi --query-gpu=index,name --format=csv | tee "$LOG"
step() { echo "== $1 done after $(( $(date +%s) - T0 )) s (exit $2)" | tee -a "$LOG"; }
if [ "${SWEEP:-1}" != 0 ]; then
  timeout -k 10 "${SWEEP_S:-200}" python3 bench/ln_linear_sweep.py --out "$OUT" 2>&1 | grep -v "^|" | tail -20 | tee -a "$LOG"
  step sweep "${PIPESTATUS[0]}"
fi
if [ "${TESTS:-1}" != 0 ]; then
  timeout -k 10 "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_fused_decode.py \
    tests/test_decode.py tests/test_generate.py 2>&1 | tail -15 | tee "$OUT/decode_gpu_tests.log" | tee -a "$LOG"
  step gpu_tests "${PIPESTATUS[0]}"
fi
if [ "${GEN:-1}" != 0 ]; then
  timeout -k 10 "${GEN_S:-200}" python3 bench/generate.py ${GEN_ARGS:---no-kernel-sweep} --out "$OUT" 2>&1 | tail -40 | tee -a "$LOG"
  step generate_bench "${PIPESTATUS[0]}"
  timeout -k 10 "${PROFILE_S:-90}" python3 bench/profile_gpu.py --only decode --out "$OUT" 2>&1 | tail -60 | tee -a "$LOG"
  step profile "${PIPESTATUS[0]}"
fi
