#!/usr/bin/env bash
# Second GPU call of the session: the GPU-only generation tests (CUDA graphs, the CLI's fused default), the
# decode benchmark and profile with the swept configs, then the training-step pair flash/sdpa + compile.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo "== $1 done after $(( $(date +%s) - T0 )) s (exit $2)"; }
timeout -k 10 "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_fused_decode.py tests/test_generate.py \
  -k "fused or cuda_graph or gpu" -rs 2>&1 | tail -8 | tee "$OUT/decode_gpu_tests2.log"
step gpu_tests "${PIPESTATUS[0]}"
OUT=$OUT SWEEP=0 TESTS=0 GEN_S=170 PROFILE_S=60 bash bench/gpu_decode.sh 2>&1 | grep -v "^ *[-a-zA-Z_:<>().,0-9 ]*  .*us  " | tail -40
step decode "$?"
if [ "${TRAIN:-1}" != 0 ]; then
  timeout -k 10 200 python3 bench/train.py --out "$OUT" --steps 15 --variants "flash+compile,sdpa+compile" 2>&1 | tail -12
  step train "$?"
fi
