#!/usr/bin/env bash
# Rebuilds the bundled models (DESIGN §8) from scratch on CPU, in order:
#   corpus + tokenizer -> target -> self-distillation data -> five drafters (equal budgets).
# Each stage resumes if interrupted (re-run the script). Logs go to workdirs/*.log.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p workdirs

python -m dspark_jax.data.prepare --kind source_tree --data-dir data/stdlib \
    --train-tokenizer --vocab-size 8192
python train.py --config configs/target_pycode.py --workdir workdirs/target_pycode
python -m dspark_jax.export --workdir workdirs/target_pycode --out assets/target --dtype bfloat16
python -m dspark_jax.eval.lm --target assets/target --data-dir data/stdlib

python -m dspark_jax.data.distill --target assets/target --corpus-dir data/stdlib \
    --out-dir data/distill --prompt-len 128 --max-new-tokens 256 --max-prompts 1536 \
    --batch-size 32 --temperature 1.0 --seed 0

for kind in dspark dspark_rnn dflash eagle3 mtp1; do
  python train.py --config "configs/drafter_${kind}.py" --workdir "workdirs/drafter_${kind}"
  python -m dspark_jax.export --workdir "workdirs/drafter_${kind}" \
      --out "assets/drafters/${kind//_/-}" --dtype bfloat16
done
