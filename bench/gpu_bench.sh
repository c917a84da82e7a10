#!/usr/bin/env bash
# The README's benchmarks on one CUDA GPU, each with the command its results folder names.
#
#   bash bench/gpu_bench.sh                       # attention, train, generate, decode, loss, llama
#   bash bench/gpu_bench.sh train_smollm2 generate_smollm2 varlen   # the Llama-family and document-mask figures
#   bash bench/gpu_bench.sh attention generate    # some of them
#   bash bench/gpu_bench.sh generate_qwen3 decode_window   # Qwen3's fused step (q and k norms in the QKV kernel);
#                                                 # the split-KV kernel with a 4096-token window against SDPA
#   bash bench/gpu_bench.sh generate_gemma3       # Gemma 3 270M's fused step (sandwich norms, GeGLU, windows)
#   bash bench/gpu_bench.sh generate_olmo2        # OLMo 2 1B's fused step (norms after the sub-blocks, q/k norms)
#   FLASHGPT_LORA_ADDMM=1 bash bench/gpu_bench.sh train_lora   # the LoRA step with the update added by addmm
#                                                 # (run it without the variable too, in the same call)
#   BASE=../other-checkout bash bench/gpu_bench.sh attention   # each benchmark in BASE first, then here, in the
#                                                 # same run: a change measured against the tree before it
#   ATTENTION_ARGS="--shapes 4,16,4096,64 --providers flash,sdpa-cudnn" bash bench/gpu_bench.sh attention
#
# Each benchmark's output goes to $OUT/<name>[_base].log (OUT defaults to runs/gpu_bench) and its result files to
# $OUT/<name>[_base]/. Copy what the README cites into bench/results/<name>/ with the command and commit.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/runs/gpu_bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/.cache/triton}

declare -A ARGS=(
  [attention]="${ATTENTION_ARGS:---deadline-s 180}"
  [train]="${TRAIN_ARGS:---steps 20 --repeats 3 --variants flash+compile,sdpa+compile,flash+graphs,sdpa+graphs}"
  [generate]="${GENERATE_ARGS:---no-kernel-sweep}"
  [decode]="${DECODE_ARGS:-}"
  [loss]="${LOSS_ARGS:-}"
  [llama]="${LLAMA_ARGS:---sweep}"
  [train_smollm2]="${TRAIN_SMOLLM2_ARGS:---model configs/smollm2_135m.toml --block 2048 --steps 20 --repeats 3 --variants flash+compile,sdpa+compile,flash+graphs,sdpa+graphs}"
  [generate_smollm2]="${GENERATE_SMOLLM2_ARGS:---model smollm2 --no-kernel-sweep}"
  [varlen]="${VARLEN_ARGS:---varlen}"
  [generate_qwen3]="${GENERATE_QWEN3_ARGS:---model qwen3 --no-kernel-sweep}"
  [generate_gemma3]="${GENERATE_GEMMA3_ARGS:---model gemma3 --no-kernel-sweep}"
  [generate_olmo2]="${GENERATE_OLMO2_ARGS:---model olmo2 --no-kernel-sweep}"
  [decode_window]="${DECODE_WINDOW_ARGS:---window 4096 --heads 16 --kv-heads 8 --head-dim 128 --providers split,nosplit,sdpa,sdpa-mask,copy}"
  [train_lora]="${TRAIN_LORA_ARGS:---model configs/smollm2_135m.toml --block 2048 --steps 20 --repeats 1 --variants flash+graphs --lora-rank 16}"
)
declare -A SCRIPT=([attention]=attention.py [train]=train.py [generate]=generate.py [decode]=decode_attention.py
                   [loss]=cross_entropy.py [llama]=llama_kernels.py
                   [train_smollm2]=train.py [generate_smollm2]=generate.py [varlen]=attention.py
                   [generate_qwen3]=generate.py [generate_gemma3]=generate.py [generate_olmo2]=generate.py [decode_window]=decode_attention.py [train_lora]=train.py)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(attention train generate decode loss llama)

status=0
bench() {  # NAME TREE SUFFIX
  local name=$1 tree=$2 suffix=$3 dir="$OUT/$1$3" t0 rc
  mkdir -p "$dir"
  t0=$(date +%s)
  # shellcheck disable=SC2086  # ARGS holds several words
  (cd "$tree" && $PY "bench/${SCRIPT[$name]}" ${ARGS[$name]} --out "$dir") > "$OUT/$name$suffix.log" 2>&1
  rc=$?
  echo "== $name$suffix: exit $rc after $(( $(date +%s) - t0 )) s: (cd $tree && python bench/${SCRIPT[$name]} ${ARGS[$name]})"
  tail -n 25 "$OUT/$name$suffix.log"
  [ $rc -eq 0 ] || status=1
}
for name in "${names[@]}"; do
  [ -n "${SCRIPT[$name]:-}" ] || { echo "error: unknown benchmark '$name' (attention, train, generate, decode, loss, llama, train_smollm2, generate_smollm2, varlen, generate_qwen3, generate_gemma3, generate_olmo2, decode_window, train_lora)"; exit 2; }
  [ -z "${BASE:-}" ] || bench "$name" "$BASE" _base
  bench "$name" "$ROOT" ""
done
exit $status
