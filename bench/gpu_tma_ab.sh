#!/usr/bin/env bash
# One device call: does the TMA load path (kernels/flash.py) hold up on the H200, and what does it move?
#   1. the flash kernel tests on the GPU (both load paths, bf16, large shapes, packed QKV, inductor compile),
#   2. bench/attention.py with TMA (flash, sdpa-flash, sdpa-cudnn; the training shape + the shapes),
#   3. the same flash-only with FLASHGPT_TMA=0 (pointer loads): the A/B of the load path,
#   4. the compiled training-step pair (flash + compile vs sdpa + compile), the model's packed-QKV path.
# Results into $OUT (the device tool's return folder).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PY:-python3}
SHAPES="16,12,1024,64 4,16,4096,64 4,16,4096,128 1,16,16384,128"
T0=$(date +%s)
timeout -k 10 "${TEST_S:-150}" $PY -m pytest tests/test_flash_attention.py -q -n "${NPROC:-12}" -p no:cacheprovider \
  -rs -k "${TEST_K:-matches_reference or unaligned or qkvpacked or compile or large_shapes or autotuned}" \
  > "$OUT/tma_gpu_tests.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - T0 )) s"; grep -E "FAILED|passed|failed|rror" "$OUT/tma_gpu_tests.log" | tail -15
ATTN_BENCH_VIA="bash bench/gpu_tma_ab.sh" timeout -k 10 "${BENCH_S:-170}" $PY bench/attention.py --out "$OUT" \
  --providers flash,sdpa-flash,sdpa-cudnn --shapes $SHAPES --tag attention_tma > "$OUT/attention_tma.log" 2>&1
echo "bench TMA exit $? after $(( $(date +%s) - T0 )) s"; grep -E "^\(|autotune" "$OUT/attention_tma.log" | cut -c1-400
FLASHGPT_TMA=0 ATTN_BENCH_VIA="FLASHGPT_TMA=0 bash bench/gpu_tma_ab.sh" timeout -k 10 "${PTR_S:-90}" $PY bench/attention.py \
  --out "$OUT" --providers flash --shapes $SHAPES --tag attention_ptr > "$OUT/attention_ptr.log" 2>&1
echo "bench pointers exit $? after $(( $(date +%s) - T0 )) s"; grep -E "^\(|autotune" "$OUT/attention_ptr.log" | cut -c1-400
mkdir -p "$OUT/train"
timeout -k 10 "${TRAIN_S:-170}" $PY bench/train.py --out "$OUT/train" --steps 30 --variants flash+compile,sdpa+compile \
  > "$OUT/train_pair.log" 2>&1
echo "train exit $? after $(( $(date +%s) - T0 )) s"; tail -6 "$OUT/train_pair.log"
