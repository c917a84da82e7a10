#!/usr/bin/env bash
# Inference- and ablation-side GPU runs in one device call, from the repository root:
#   1. the CPU-portable test files on the GPU (decode kernel, KV-cache generation, model, online softmax), bf16 included
#   2. bench/generate.py   decode variants side by side + the split-KV decode kernel sweep
#   3. ablate.py           the full naive-vs-flash ablation (sweep, matched training runs, context probe)
# Needs the wheels from ../shared/tools/device-wheels.sh in .whl. Results are packed to stay within the
# device tool's file limits: ablation.tgz holds the whole ablation run folder.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
T0=$(date +%s)
LOG="$OUT/gpu_inference.log"
nvidia-smi --query-gpu=index,name --format=csv | tee "$LOG"
step() { echo "== $1 done after $(( $(date +%s) - T0 )) s (exit $2)" | tee -a "$LOG"; }
timeout -k 10 "${TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider -x tests/test_decode.py tests/test_generate.py 2>&1 | tail -15 | tee "$OUT/inference_gpu_tests.log" | tee -a "$LOG"
step gpu_tests "${PIPESTATUS[0]}"
timeout -k 10 "${GEN_S:-220}" python3 bench/generate.py --compile --out "$OUT" 2>&1 | tail -45 | tee -a "$LOG"
step generate_bench "${PIPESTATUS[0]}"
timeout -k 10 "${ABLATE_S:-220}" python3 ablate.py --out runs/ablation --budget "${ABLATE_BUDGET:-190}" > "$OUT/ablation.log" 2>&1
step ablation "$?"
tail -25 "$OUT/ablation.log" | tee -a "$LOG"
tar czf "$OUT/ablation.tgz" -C runs ablation
