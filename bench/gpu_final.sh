#!/usr/bin/env bash
# Last GPU session: the generation/decode tests on the GPU (CUDA graphs, bf16), then bench/profile_gpu.py.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
T0=$(date +%s)
timeout -k 10 "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_generate.py tests/test_decode.py \
  tests/test_model.py -rs 2>&1 | tail -25 | tee "$OUT/inference_gpu_tests.log"
echo "== tests exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/inference_gpu_tests.log"
timeout -k 10 "${PROFILE_S:-150}" python3 bench/profile_gpu.py --out "$OUT" 2>&1 | tail -5
echo "== profile exit ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
