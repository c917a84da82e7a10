#!/usr/bin/env bash
# Programmatic dependent launch on the GPU in one device call, from the repository root:
#   1. the fused-decode and decode-kernel tests on the GPU (bf16, CUDA graphs with and without PDL)
#   2. bench/pdl_sweep.py     PDL and tile settings on whole decode steps (batch 1 and 16)
#   3. bench/generate.py      the default fused step against plain PyTorch + CUDA graph (the targets;
#                             GEN_ARGS replaces the arguments, e.g. GEN_ARGS="--reps 5" for every variant)
#   4. PROFILE=1: bench/profile_gpu.py --only decode (kernels per fused decode step)
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo "== $1 done after $(( $(date +%s) - T0 )) s (exit $2)"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${TESTS:-1}" != 0 ]; then
  timeout -k 10 "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_fused_decode.py \
    tests/test_decode.py 2>&1 | tail -15 | tee "$OUT/pdl_gpu_tests.log"
  step gpu_tests "${PIPESTATUS[0]}"
fi
if [ "${SWEEP:-1}" != 0 ]; then
  timeout -k 10 "${SWEEP_S:-240}" python3 bench/pdl_sweep.py --out "$OUT" ${SWEEP_SETTINGS:+--settings "$SWEEP_SETTINGS"} 2>&1 | grep -v '^{' | tail -30
  step pdl_sweep "${PIPESTATUS[0]}"
fi
if [ "${GEN:-1}" != 0 ]; then
  timeout -k 10 "${GEN_S:-150}" python3 bench/generate.py ${GEN_ARGS:---no-kernel-sweep --reps 5 \
    --variants flashgpt-fused+graph,sdpa+graph} --out "$OUT" 2>&1 | tail -40
  step generate_bench "${PIPESTATUS[0]}"
fi
if [ "${PROFILE:-0}" != 0 ]; then
  timeout -k 10 "${PROFILE_S:-90}" python3 bench/profile_gpu.py --only decode --out "$OUT" 2>&1 | grep -v "^ *[-]" | head -40
  step profile "${PIPESTATUS[0]}"
fi
