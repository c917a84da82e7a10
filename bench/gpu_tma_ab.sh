#!/usr/bin/env bash
# Device calls for the TMA load path (kernels/flash.py) and the training step, run from the repository root:
#   tests    the flash kernel tests on the GPU (both load paths, bf16, large shapes, packed QKV, compile),
#   tma      bench/attention.py with the default load policy (flash, sdpa-flash, sdpa-cudnn),
#   ptr      the same, flash only, with FLASHGPT_TMA=0 (pointer loads everywhere): the A/B of the load path,
#   forced   the same, flash only, with FLASHGPT_TMA_MIN_D=16 (descriptors at every head dim),
#   train    the compiled training-step pair (flash + compile vs sdpa + compile), the model's packed-QKV path,
#   profile  bench/profile_gpu.py --only train (kernels by GPU time, flash vs sdpa, under compile),
#   lpt      bench/lpt_ab.py (causal grid order: longest-first vs per-head, CUDA-graph timed),
#   host     bench/host_overhead.py (host time per attention op call, flash vs cuDNN),
#   idle     bench/idle_gaps.py (idle GPU time between the kernels of a synchronised training step).
# STEPS picks them (default: all but forced), SHAPES the attention shapes. Results into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PY:-python3}
STEPS=${STEPS:-tests,tma,ptr,train,profile}
SHAPES=${SHAPES:-16,12,1024,64 4,16,4096,64 4,16,4096,128 1,16,16384,128}
T0=$(date +%s)
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has tests; then
  timeout -k 10 "${TEST_S:-150}" $PY -m pytest tests/test_flash_attention.py -q -n "${NPROC:-12}" -p no:cacheprovider \
    -rs -k "${TEST_K:-matches_reference or unaligned or qkvpacked or compile or large_shapes or autotuned}" \
    > "$OUT/tma_gpu_tests.log" 2>&1
  echo "pytest exit $? after $(( $(date +%s) - T0 )) s"; grep -E "FAILED|passed|failed" "$OUT/tma_gpu_tests.log" | tail -15
fi
bench() {  # tag, providers, env...
  local tag=$1 providers=$2; shift 2
  env "$@" ATTN_BENCH_VIA="$* STEPS=$tag bash bench/gpu_tma_ab.sh" timeout -k 10 "${BENCH_S:-170}" $PY bench/attention.py \
    --out "$OUT" --providers "$providers" --shapes $SHAPES --tag "attention_$tag" > "$OUT/attention_$tag.log" 2>&1
  echo "bench $tag exit $? after $(( $(date +%s) - T0 )) s"; grep -E "^\(|autotune" "$OUT/attention_$tag.log" | cut -c1-400
}
has tma && bench tma flash,sdpa-flash,sdpa-cudnn FLASHGPT_TMA=1
has ptr && bench ptr flash FLASHGPT_TMA=0
has forced && bench forced flash FLASHGPT_TMA_MIN_D=16
if has lpt; then
  timeout -k 10 "${LPT_S:-150}" $PY bench/lpt_ab.py --out "$OUT" > "$OUT/lpt_ab.log" 2>&1
  echo "lpt exit $? after $(( $(date +%s) - T0 )) s"; tail -8 "$OUT/lpt_ab.log"
fi
if has host; then
  timeout -k 10 "${HOST_S:-60}" $PY bench/host_overhead.py --out "$OUT" > "$OUT/host_overhead.log" 2>&1
  echo "host exit $? after $(( $(date +%s) - T0 )) s"; tail -12 "$OUT/host_overhead.log"
fi
if has idle; then
  timeout -k 10 "${IDLE_S:-200}" $PY bench/idle_gaps.py --out "$OUT" > "$OUT/idle_gaps.log" 2>&1
  echo "idle exit $? after $(( $(date +%s) - T0 )) s"; head -8 "$OUT/idle_gaps.md"
fi
if has train; then
  mkdir -p "$OUT/train"
  timeout -k 10 "${TRAIN_S:-300}" $PY bench/train.py --out "$OUT/train" --steps 30 --repeats "${REPEATS:-3}" \
    --variants flash+compile,sdpa+compile \
    > "$OUT/train_pair.log" 2>&1
  echo "train exit $? after $(( $(date +%s) - T0 )) s"; tail -6 "$OUT/train_pair.log"
fi
if has profile; then
  timeout -k 10 "${PROFILE_S:-200}" $PY bench/profile_gpu.py --only train --out "$OUT" > "$OUT/profile_train.log" 2>&1
  echo "profile exit $? after $(( $(date +%s) - T0 )) s"
fi
