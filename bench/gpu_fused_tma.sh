#!/usr/bin/env bash
# Device calls for the fused backward with TMA reduce-adds of dQ (kernels/flash.py, FUSED_DQ=2), from the
# repository root; STEPS picks the stages (default tiles,tests), results into $OUT:
#   tiles  bench/tiles.py --kernels dq,dkdv,dkdvq: the split backward's configs against the fused one's
#   tests  the fused backward's GPU tests (bf16, both dQ accumulations, every dK/dV config at d64) + replays
#   kernels bench/bwd_kernels.py: GPU time per kernel of the split backward and the fused one (both dQ adds)
#   train  bench/train.py: VARIANTS (default flash + compile with the split and the fused backward, and
#          sdpa + compile), REPEATS processes each
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PY:-python3}
STEPS=${STEPS:-tiles,tests}
T0=$(date +%s)
has() { [[ ",$STEPS," == *",$1,"* ]]; }
$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
if has tiles; then
  timeout -k 10 "${TILES_S:-240}" $PY bench/tiles.py --kernels dq,dkdv,dkdvq --rounds "${ROUNDS:-3}" --out "$OUT" \
    > "$OUT/tiles.log" 2>&1
  echo "tiles exit $? after $(( $(date +%s) - T0 )) s"; grep -A4 "^## dkdvq\|^## dkdv \|^## dq" "$OUT/tiles.log" | grep "^|" | grep -v -- "---"
fi
if has tests; then
  NP=$($PY -c "import xdist" 2>/dev/null && echo "-n ${NPROC:-12}")
  timeout -k 10 -s INT "${TEST_S:-240}" $PY -m pytest tests/test_flash_attention.py -q $NP -p no:cacheprovider -rs \
    -k "${TEST_K:-fused or replay or (every_autotune_config and d64 and bfloat16)}" > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $? after $(( $(date +%s) - T0 )) s"; grep -E "FAILED|Error|passed|failed" "$OUT/gpu_tests.log" | tail -15
fi
if has kernels; then
  timeout -k 10 "${KERNELS_S:-200}" $PY bench/bwd_kernels.py --modes split,fused:1,fused:2 --out "$OUT" \
    > "$OUT/bwd_kernels.log" 2>&1
  echo "bwd_kernels exit $? after $(( $(date +%s) - T0 )) s"; grep "^|\|^##" "$OUT/bwd_kernels.log"
fi
if has train; then
  timeout -k 10 "${TRAIN_S:-420}" $PY bench/train.py --out "$OUT/ab" --steps "${TRAIN_STEPS:-20}" --repeats "${REPEATS:-2}" \
    --variants "${VARIANTS:-flash+compile/split,flash+compile/fused,sdpa+compile}" > "$OUT/train_ab.log" 2>&1
  echo "train exit $? after $(( $(date +%s) - T0 )) s"; tail -25 "$OUT/train_ab.log"
fi
