#!/usr/bin/env bash
# The FlashAttention kernel's GPU check, in one device call (run from the repository root):
#   1. the kernel tests on the GPU (bf16 cases, large shapes, every autotune config, inductor compile),
#   2. bench/attention.py (all providers, one table), while
#   0. FlexAttention's compile for the benchmark shapes runs in the background during the tests (it fills
#      the inductor cache, so the benchmark itself does not wait for it).
# Logs and results go to $OUT (the device tool's return folder) and to bench/results/.
# Budget: tests <= TEST_S (200 s), benchmark <= BENCH_S (280 s, it skips what would start after 230 s).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PY=${PY:-python3}
LOG="$OUT/attention_gpu_tests.log"
{
  echo "# bash bench/gpu_kernel_check.sh — $(date -u '+%Y-%m-%d %H:%M UTC')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
} 2>&1 | tee "$LOG"
T0=$(date +%s)
timeout -k 10 "${FLEX_WARM_S:-200}" $PY bench/attention.py --warm-compile-only --providers flex \
  > "$OUT/attention_flex_warm.log" 2>&1 &
WARM=$!
timeout -k 20 -s INT "${TEST_S:-200}" $PY -m pytest tests/test_flash_attention.py -q -n "${NPROC:-12}" \
  -p no:cacheprovider -rs --durations=10 ${PYTEST_ARGS:-} 2>&1 | tee -a "$LOG"
echo "pytest exit status ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
wait $WARM; echo "flex warm-up exit status $? after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/attention_flex_warm.log"
ATTN_BENCH_VIA="${ATTN_BENCH_VIA:-bash bench/gpu_kernel_check.sh}" \
timeout -k 10 "${BENCH_S:-280}" $PY bench/attention.py --out "$OUT" --deadline-s "${BENCH_DEADLINE_S:-230}" \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/attention_bench.log"
echo "bench exit status ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/attention_bench.log"
