#!/usr/bin/env bash
# Time to first token of each turn of a `generate.py --chat` conversation, with the flash autotuners as they were
# (every call tuned, nothing kept on disk) and as they are (kernels.options: autotune_min_keys, autotune_cache),
# each in a fresh Triton cache folder and again in the same folder (a second process). Needs a CUDA GPU and
# transformers (the random model is written with save_pretrained; no download).
#
#   bash bench/chat_first_token.sh [OUT]      # default OUT: runs/chat_first_token
#
# The model: a random Llama of 4 layers, 512 wide, 8 heads of 64, context 2048, with the tests' BPE tokenizer and
# ChatML template (tests/hf_models.py). Six user messages of 5-400 words, 48 new tokens each (greedy, --no-stop),
# so the conversation grows through the 16-2048 key-length buckets. OUT/first_token.log has one line per turn.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/chat_first_token}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
LOG=$OUT/first_token.log
echo "== $(git rev-parse --short HEAD 2>/dev/null || echo '?'): $("$PY" -c 'import torch, triton
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (sdpa on the CPU: nothing is tuned)"
print(gpu, "torch", torch.__version__, "triton", triton.__version__)')" | tee "$LOG"
"$PY" - "$SCRATCH" <<'EOF' || exit 1
import sys
sys.path.insert(0, ".")
import transformers
from tests.hf_models import randomised, write_tokenizer
from tests.util import write_corpus
scratch = sys.argv[1]
lines = open(write_corpus(f"{scratch}/corpus", n_lines=400)).read().splitlines()
folder = write_tokenizer(f"{scratch}/model", lines)
cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
                               num_hidden_layers=4, vocab_size=320, max_position_embeddings=2048, eos_token_id=0,
                               bos_token_id=None, tie_word_embeddings=True)
randomised(transformers.LlamaForCausalLM(cfg)).save_pretrained(folder, safe_serialization=True)
EOF
messages=$("$PY" -c "
import random
r, words = random.Random(0), 'the king queen sword night love crown speak thou art fair and'.split()
for n in (5, 40, 90, 160, 250, 400): print(' '.join(r.choice(words) for _ in range(n)))")
converse() {  # converse LABEL VAR=VALUE...: one conversation with these environment settings
  local label=$1; shift
  echo "== $label ($*)" | tee -a "$LOG"
  echo "$messages" | env "$@" "$PY" generate.py --init-from "hf:$SCRATCH/model" --chat --max-new-tokens 48 \
    --temperature 0 --no-stop --no-stream > "$SCRATCH/$label.out" 2> "$OUT/$label.err"
  echo "exit $?" | tee -a "$LOG"
  grep "prompt tokens" "$OUT/$label.err" | sed 's/, decode.*//' | tee -a "$LOG"
}
OLD=(FLASHGPT_AUTOTUNE_MIN_KEYS=0 FLASHGPT_AUTOTUNE_CACHE=0)
converse tune_every_call_fresh_cache TRITON_CACHE_DIR="$SCRATCH/cache_old" "${OLD[@]}"
converse tune_every_call_same_cache TRITON_CACHE_DIR="$SCRATCH/cache_old" "${OLD[@]}"
converse default_fresh_cache TRITON_CACHE_DIR="$SCRATCH/cache_new"
converse default_same_cache TRITON_CACHE_DIR="$SCRATCH/cache_new"
echo "autotune timings kept on disk: $(ls "$SCRATCH"/cache_new/*/*.autotune.json 2>/dev/null | wc -l) files" | tee -a "$LOG"
