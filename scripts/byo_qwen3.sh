#!/usr/bin/env bash
# Bring your own Qwen3: from a local Hugging Face Qwen3 directory to a calibrated DSpark
# drafter, evaluated, served and answering one chat request (docs/guides/train-drafter.md).
#
#   MODEL=/path/to/Qwen3-8B WORK=/tmp/byoq PROMPTS=my_prompts.jsonl scripts/byo_qwen3.sh
#   MODEL=/path/to/Qwen3-8B WORK=/tmp/byoq SMALL=1 scripts/byo_qwen3.sh   # tiny sizes
#
# SMALL=1 runs every step at tiny sizes (a 1-layer drafter, 8 steps): the point is that
# each step runs, not the drafter (minutes on an accelerator; on 2 CPU cores, for a tiny
# checkpoint). CI runs it that way on a tiny random Qwen3
# (scripts/make_tiny_qwen3.py; tests/scripts/test_byo_qwen3.py), which also checks that the guide's
# command block is the STEPS section below.
#
# Settings (environment):
#   MODEL, WORK      your Qwen3 directory; a directory for everything this writes
#   PROMPTS          JSONL prompts ({"turns": [...]}) for calibration and evaluation:
#                    hundreds (needed at full size; SMALL=1 writes four to $WORK)
#   CORPUS           text the drafter learns to follow: a directory of source files, or a
#                    .jsonl file of {"turns": [...]} prompts. Default: Python's standard
#                    library (SMALL=1: this package's own source)
#   TRAIN_FLAGS      extra train.py overrides, e.g. "--config.train.steps=4000
#                    --config.data.batch_size=16" (keys: docs/reference/config-keys.md)
#   CALIBRATE_FLAGS  extra calibrate flags, e.g. "--mode affine"
#   SERVE_FLAGS      extra serve.py flags, e.g. "--dtype bfloat16 --attention xla"
#   PORT             the server's port (default: a free one)
# A rerun picks up where it stopped: the corpus is kept, distillation and training resume.
set -euo pipefail
: "${MODEL:?set MODEL to your Hugging Face Qwen3 directory}"
: "${WORK:?set WORK to a directory for the corpus, the data, the run and the drafter}"
# Paths are relative to where the script was started; it then works from the repository.
here() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
MODEL=$(here "$MODEL")
WORK=$(here "$WORK")
if [ -n "${CORPUS:-}" ]; then CORPUS=$(here "$CORPUS"); fi
if [ -n "${PROMPTS:-}" ]; then PROMPTS=$(here "$PROMPTS"); fi
cd "$(dirname "$0")/.."
mkdir -p "$WORK"
for f in config.json tokenizer.json; do
    if [ ! -f "$MODEL/$f" ]; then
        echo "error: $MODEL has no $f (not a Hugging Face Qwen3 directory?)" >&2
        exit 2
    fi
done

if [ "${SMALL:-0}" = 1 ]; then
    CORPUS=${CORPUS:-$PWD/dspark_jax}
    PROMPT_LEN=32 NEW_TOKENS=32 MAX_PROMPTS=16 DISTILL_BATCH=8
    # The named config at smoke size, by overrides (each --config.x.y is a config key);
    # gamma 2 (the recipe's: 7) leaves evaluation and serving fewer verify shapes to compile.
    TRAIN_FLAGS="--config.train.steps=8 --config.data.batch_size=4 --config.drafter.gamma=2
        --config.drafter.num_layers=1 --config.drafter.markov_rank=16
        --config.drafter.anchors_per_seq=4 --config.drafter.eval_anchors_per_seq=4
        --config.train.log_every=1 --config.train.eval_every=8 --config.train.eval_batches=1
        --config.train.checkpoint_every=8 ${TRAIN_FLAGS:-}"
    EVAL_TOKENS=16 EVAL_SLOTS=4
    # Four prompts give a few dozen rounds: write the fit whatever its held-out ECE.
    CALIBRATE_FLAGS="--min-fit-rounds 0 --force ${CALIBRATE_FLAGS:-}"
    SERVE_FLAGS="--slots 1 --max-len 64 --sps-cache $WORK/sps.json
        --compile-cache $WORK/jax_cache ${SERVE_FLAGS:-}"
    CHAT_TOKENS=16
    # One compilation cache for every step: evaluation reuses calibration's programs.
    export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jax_cache}
    if [ -z "${PROMPTS:-}" ]; then
        PROMPTS=$WORK/prompts.jsonl
        cat > "$PROMPTS" <<'END'
{"turns": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]}
{"turns": ["class Stack:\n    def __init__(self):\n"]}
{"turns": ["def read_lines(path):\n"]}
{"turns": ["import os\n\n\ndef list_python_files(root):\n"]}
END
    fi
else
    CORPUS=${CORPUS:-$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')}
    PROMPT_LEN=128 NEW_TOKENS=256 MAX_PROMPTS=16384 DISTILL_BATCH=32
    TRAIN_FLAGS=${TRAIN_FLAGS:-}
    EVAL_TOKENS=256 EVAL_SLOTS=8
    CALIBRATE_FLAGS=${CALIBRATE_FLAGS:-}
    SERVE_FLAGS=${SERVE_FLAGS:-}
    CHAT_TOKENS=128
    if [ -z "${PROMPTS:-}" ]; then
        echo "error: set PROMPTS to a JSONL file of prompts ({\"turns\": [...]}), hundreds of" \
            "them: calibration fits from 200 decode rounds at least (or run with SMALL=1)" >&2
        exit 2
    fi
fi
case "$CORPUS" in
    *.jsonl) CORPUS_KIND=jsonl ;;
    *) CORPUS_KIND=source_tree ;;
esac
PORT=${PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
step() { echo; echo "== $* ($(date +%T))"; }

# ---- STEPS: docs/guides/train-drafter.md shows this section (less the `step` lines) ----
# 1. A corpus of text to continue (no tokenizer is trained: step 2 uses the model's own)
step "1. corpus: $CORPUS"
python -m dspark_jax.data.prepare --kind $CORPUS_KIND --source "$CORPUS" --data-dir "$WORK/corpus"

# 2. Self-distillation: the model continues corpus windows, with its own tokenizer.json
step "2. self-distillation"
python -m dspark_jax.data.distill --target "$MODEL" --corpus-dir "$WORK/corpus" \
    --out-dir "$WORK/distill" --prompt-len $PROMPT_LEN --max-new-tokens $NEW_TOKENS \
    --max-prompts $MAX_PROMPTS --batch-size $DISTILL_BATCH --no-progress

# 3. Train: the named config, the two overrides every run needs, the record length
step "3. train"
python train.py --config configs/recipes/drafter_dspark_my_qwen3.py --workdir "$WORK/run" \
    --config.target.dir="$MODEL" --config.data.data_dir="$WORK/distill" \
    --config.data.seq_len=$((PROMPT_LEN + NEW_TOKENS)) $TRAIN_FLAGS --no-progress

# 4. Export the last checkpoint as a drafter directory
step "4. export"
python -m dspark_jax.export --workdir "$WORK/run" --out "$WORK/drafter" --dtype bfloat16

# 5. Calibrate the confidence head (sequential temperature scaling: <drafter>/sts.json)
step "5. calibrate"
python -m dspark_jax.eval calibrate --target "$MODEL" --drafter "$WORK/drafter" \
    --prompts "$PROMPTS" --temperature 1 --max-new-tokens $EVAL_TOKENS --slots $EVAL_SLOTS \
    --out "$WORK/drafter/sts.json" --overwrite --no-progress $CALIBRATE_FLAGS

# 6. Evaluate: acceptance per draft position, greedy and sampled verification
step "6. evaluate"
python -m dspark_jax.eval acceptance --target "$MODEL" --drafter "$WORK/drafter" \
    --prompts "$PROMPTS" --temperature 0 1 --max-new-tokens $EVAL_TOKENS --slots $EVAL_SLOTS \
    --out "$WORK/acceptance.json" --no-progress

# 7. Serve with the drafter, wait for /health (200 once compiled), chat once, then stop
#    the server (SIGTERM drains it; it exits with status 0)
step "7. serve and chat"
python serve.py --target "$MODEL" --drafter "$WORK/drafter" --port $PORT $SERVE_FLAGS &
SERVER=$!
trap 'kill $SERVER 2> /dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $SERVER || { echo "error: serve.py exited during start-up" >&2; exit 1; }
    sleep 2
done
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H "Content-Type: application/json" \
    -d '{"messages": [{"role": "user", "content": "Write a function that reverses a list."}],
         "max_tokens": '$CHAT_TOKENS'}' > "$WORK/chat.json"
kill -TERM $SERVER && wait $SERVER
trap - EXIT
# ---- end of STEPS ----

python - "$WORK" <<'END'
import json, sys

work = sys.argv[1]
reply = json.load(open(f"{work}/chat.json"))["choices"][0]["message"]["content"]
print(f"\nchat reply: {reply!r}\ndrafter: {work}/drafter\nacceptance: {work}/acceptance.json")
END
